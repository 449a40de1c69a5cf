"""The run's timeline: a picture like a profiler trace, and the trace itself (Chrome/Perfetto).

Lanes: the learner (each call it ran, coloured by kind: streamed backward passes, the step's
close, the optimizer step, the weight gather and probe), weight syncs, and rollout (episodes in
flight over time, with reward arrivals). The trace also holds each episode's turns (process
"turns", one thread per episode: a ``generate`` span with its token count, then a ``tool`` span),
which ``megathunder simulate --calibrate`` fits its rollout inputs from. ``trace.json`` opens in chrome://tracing or
ui.perfetto.dev.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from megathunder.learner.service import Span, drop_front  # noqa: E402
from megathunder.rollout.episode import Episode  # noqa: E402

COLOURS = {
    "finished": "#4c72b0", "reward": "#55a868", "close": "#8172b2", "step": "#c44e52",
    "send_weights": "#dd8452", "gather_weights": "#dd8452", "score": "#937860", "begin": "#999999", "checkpoint": "#64b5cd",
}  # fmt: skip


@dataclass
class Timeline:
    """The rollout side's spans of the last ``run.timeline_steps`` steps (the learner's own spans are
    the ``LearnerService``'s): each episode, and each weight sync."""

    episodes: list[dict] = field(default_factory=list)
    syncs: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, policy version)
    initial_version: int | None = None  # the sync at engine start (weights before any step of this run)

    def add_episodes(self, step: int, episodes: Sequence[Episode]) -> None:
        for e in episodes:
            self.episodes.append({
                "step": step, "start": e.started_at, "finished": e.finished_at, "reward": e.reward_time,
                "turns": len(e.turns), "group": e.group_id, "prompt_tokens": e.prompt_len,
                "tokens": len(e.token_ids), "setup_s": e.setup_s, "turn_spans": [
                    (t.started_at, t.generated_at, t.tools_done_at, t.end - t.start) for t in e.turns],
            })  # fmt: skip

    def add_sync(self, start: float, end: float, version: int) -> None:
        if not self.syncs and self.initial_version is None:
            self.initial_version = version
        self.syncs.append((start, end, version))

    def keep_from(self, first_step: int) -> None:
        """Only the spans of steps >= ``first_step`` (version v follows step v - 1). Both lists grow
        in step order, so older entries go from the front."""
        drop_front(self.episodes, lambda e: e["step"] < first_step)
        drop_front(self.syncs, lambda s: s[2] < first_step)

    def write(self, out: Path, spans: Sequence[Span], rows: Sequence[dict]) -> None:
        """``trace.json`` and ``timeline.png`` of the learner's ``spans`` and these."""
        t0 = min([s.start for s in spans] + [e["start"] for e in self.episodes], default=0.0)
        write_trace(out / "trace.json", spans, self.episodes, self.syncs, t0, self.initial_version)
        _plot(out / "timeline.png", spans, self.episodes, self.syncs, rows, t0, self.initial_version)


def _sync_name(version: int, initial: int | None) -> str:
    if version == initial:
        return f"engine start: weights v{version} loaded into vLLM"
    return f"weight sync v{version}"


def write_trace(path: Path, spans, episodes, syncs, t0: float, initial_version: int | None = None) -> None:
    """``spans``: the learner's calls (kind, start, end, step); ``episodes``: ``Trainer.episode_spans``;
    ``syncs``: (start, end, version) of each weight sync; times are ``time.monotonic()``."""
    us = lambda t: round((t - t0) * 1e6)  # noqa: E731
    events = [{"name": "process_name", "ph": "M", "pid": p, "args": {"name": n}}
              for p, n in ((0, "learner"), (1, "rollout"), (2, "turns"))]
    for s in spans:
        events.append({"name": s.kind, "ph": "X", "pid": 0, "tid": 0, "ts": us(s.start),
                       "dur": us(s.end) - us(s.start), "args": {"step": s.step}})
    for a, b, version in syncs:
        events.append({"name": _sync_name(version, initial_version), "ph": "X", "pid": 0, "tid": 1, "ts": us(a), "dur": us(b) - us(a)})
    for k, e in enumerate(episodes):
        tid = k % 64
        events.append({"name": "generate+tools", "ph": "X", "pid": 1, "tid": tid, "ts": us(e["start"]),
                       "dur": us(e["finished"]) - us(e["start"]), "args": {"step": e["step"], "turns": e["turns"], "episode": k,
                                **{key: e[key] for key in ("group", "prompt_tokens", "tokens", "setup_s") if key in e}}})
        events.append({"name": "verify", "ph": "X", "pid": 1, "tid": tid, "ts": us(e["finished"]),
                       "dur": us(e["reward"]) - us(e["finished"])})
        for started, generated, tools_done, tokens in e.get("turn_spans", ()):
            events.append({"name": "generate", "ph": "X", "pid": 2, "tid": k, "ts": us(started),
                           "dur": us(generated) - us(started), "args": {"tokens": tokens}})
            if tools_done is not None:
                events.append({"name": "tool", "ph": "X", "pid": 2, "tid": k, "ts": us(generated),
                               "dur": us(tools_done) - us(generated)})
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def _plot(path: Path, spans, episodes, syncs, rows, t0: float, initial_version: int | None) -> None:
    fig, (ax_l, ax_r, ax_m) = plt.subplots(3, 1, figsize=(12, 7), sharex=False,
                                           gridspec_kw={"height_ratios": [1.2, 2, 1.6]})
    end = max([s.end for s in spans] + [e["reward"] for e in episodes] + [t0 + 1e-3]) - t0
    # learner lane: busy spans by kind; gaps are idle
    for kind, colour in COLOURS.items():
        bars = [(s.start - t0, s.end - s.start) for s in spans if s.kind == kind]
        if bars:
            ax_l.broken_barh(bars, (0.1, 0.8), facecolors=colour, label=kind)
    first = [(a - t0, b - a) for a, b, v in syncs if v == initial_version]
    later = [(a - t0, b - a) for a, b, v in syncs if v != initial_version]
    if first:
        ax_l.broken_barh(first, (1.1, 0.8), facecolors="#bbbbbb", label="engine start (initial weights)")
    if later:
        ax_l.broken_barh(later, (1.1, 0.8), facecolors="#dd8452", label="weight sync")
    ax_l.set_yticks([0.5, 1.5], ["learner", "sync"])
    ax_l.set_xlim(0, end)
    ax_l.legend(loc="upper left", ncol=1, fontsize=6, bbox_to_anchor=(1.005, 1.0))
    ax_l.set_title("learner busy (coloured, by call) / idle (blank)", fontsize=9)
    # rollout lane: episodes in flight, reward arrivals
    points = sorted([(e["start"] - t0, 1) for e in episodes] + [(e["finished"] - t0, -1) for e in episodes])
    xs, ys, level = [0.0], [0], 0
    for t, d in points:
        xs.append(t)
        ys.append(level)
        level += d
        xs.append(t)
        ys.append(level)
    ax_r.fill_between(xs, ys, step=None, color="#4c72b0", alpha=0.4, label="episodes generating / in tools")
    ax_r.plot([e["reward"] - t0 for e in episodes], [0] * len(episodes), "|", color="#55a868", ms=12,
              label="reward arrives")
    ax_r.set_xlim(0, end)
    ax_r.set_ylabel("episodes")
    ax_r.set_xlabel("seconds since the first step")
    ax_r.legend(fontsize=7, loc="upper right")
    # per step: reward and learner idle share
    steps = [r["step"] for r in rows]
    ax_m.plot(steps, [r["reward_mean"] for r in rows], "o-", color="#55a868", label="mean reward")
    ax_m.set_ylabel("reward")
    ax_m.set_xlabel("optimizer step")
    ax2 = ax_m.twinx()
    ax2.bar(steps, [r["learner_idle_share"] for r in rows], color="#999999", alpha=0.35, label="learner idle share")
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("idle share")
    ax_m.legend(loc="upper left", fontsize=7)
    ax2.legend(loc="upper right", fontsize=7)
    schedule = rows[-1]["schedule"] if rows else "?"
    fig.suptitle(f"megathunder run timeline ({schedule})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
