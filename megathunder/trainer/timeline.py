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
from pathlib import Path

COLOURS = {
    "finished": "#4c72b0", "reward": "#55a868", "close": "#8172b2", "step": "#c44e52",
    "gather_weights": "#dd8452", "score": "#937860", "begin": "#999999", "checkpoint": "#64b5cd",
}  # fmt: skip


def write_timeline(out: Path, trainer) -> None:
    spans = list(trainer.service.spans)
    t0 = min([s.start for s in spans] + [e["start"] for e in trainer.episode_spans], default=0.0)
    write_trace(out / "trace.json", spans, trainer.episode_spans, trainer.sync_spans, t0)
    _plot(out / "timeline.png", spans, trainer.episode_spans, trainer.sync_spans, trainer.metrics.rows, t0)


def write_trace(path: Path, spans, episodes, syncs, t0: float) -> None:
    """``spans``: the learner's calls (kind, start, end, step); ``episodes``: ``Trainer.episode_spans``;
    ``syncs``: (start, end, version) of each weight sync; times are ``time.monotonic()``."""
    us = lambda t: round((t - t0) * 1e6)  # noqa: E731
    events = [{"name": "process_name", "ph": "M", "pid": p, "args": {"name": n}}
              for p, n in ((0, "learner"), (1, "rollout"), (2, "turns"))]
    for s in spans:
        events.append({"name": s.kind, "ph": "X", "pid": 0, "tid": 0, "ts": us(s.start),
                       "dur": us(s.end) - us(s.start), "args": {"step": s.step}})
    for a, b, version in syncs:
        events.append({"name": f"weight sync v{version}", "ph": "X", "pid": 0, "tid": 1, "ts": us(a), "dur": us(b) - us(a)})
    for k, e in enumerate(episodes):
        tid = k % 64
        events.append({"name": "generate+tools", "ph": "X", "pid": 1, "tid": tid, "ts": us(e["start"]),
                       "dur": us(e["finished"]) - us(e["start"]), "args": {"step": e["step"], "turns": e["turns"], "episode": k,
                                **{key: e[key] for key in ("group", "prompt_tokens", "tokens") if key in e}}})
        events.append({"name": "verify", "ph": "X", "pid": 1, "tid": tid, "ts": us(e["finished"]),
                       "dur": us(e["reward"]) - us(e["finished"])})
        for started, generated, tools_done, tokens in e.get("turn_spans", ()):
            events.append({"name": "generate", "ph": "X", "pid": 2, "tid": k, "ts": us(started),
                           "dur": us(generated) - us(started), "args": {"tokens": tokens}})
            if tools_done is not None:
                events.append({"name": "tool", "ph": "X", "pid": 2, "tid": k, "ts": us(generated),
                               "dur": us(tools_done) - us(generated)})
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def _plot(path: Path, spans, episodes, syncs, rows, t0: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_l, ax_r, ax_m) = plt.subplots(3, 1, figsize=(12, 7), sharex=False,
                                           gridspec_kw={"height_ratios": [1.2, 2, 1.6]})
    end = max([s.end for s in spans] + [e["reward"] for e in episodes] + [t0 + 1e-3]) - t0
    # learner lane: busy spans by kind; gaps are idle
    for kind, colour in COLOURS.items():
        bars = [(s.start - t0, s.end - s.start) for s in spans if s.kind == kind]
        if bars:
            ax_l.broken_barh(bars, (0.1, 0.8), facecolors=colour, label=kind)
    ax_l.broken_barh([(a - t0, b - a) for a, b, _ in syncs], (1.1, 0.8), facecolors="#dd8452", label="weight sync")
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
