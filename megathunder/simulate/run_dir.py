"""Reading a real run's directory (``megathunder train``): its config, per-step metrics and trace.

What calibration uses from ``trace.json`` (written by ``megathunder.trainer.timeline``):

- process 0, thread 0: every learner call as a span named by its kind (``begin``, ``finished``,
  ``reward``, ``close``, ``step``, ``send_weights``, ``score``, ...);
- process 0, thread 1: every weight sync (gather + load into vLLM + probe), ``weight sync vN``;
- process 1: every episode's ``generate+tools`` span (args: step, group, prompt and total tokens,
  ``setup_s``: the seconds its sandbox and task set-up took before it) followed by its ``verify`` span;
- process 2, thread = the episode's index: each turn's ``generate`` span (args: tokens) and
  ``tool`` span.

Times are seconds from the trace's origin. ``metrics.jsonl`` gives the measured step times, which
calibration compares against and never fits from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megathunder.config.loader import ConfigError

REQUIRED_FILES = ("config.yaml", "metrics.jsonl", "trace.json")


@dataclass(frozen=True)
class Span:
    kind: str
    start: float
    end: float
    step: int = -1  # learner calls: the optimizer step it belongs to

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Turn:
    start: float  # request sent to the engine
    end: float  # completion returned
    tokens: int  # generated


@dataclass
class Episode:
    step: int
    group: int
    start: float
    finished: float
    reward: float
    prompt_tokens: int
    tokens: int  # whole context: prompt, turns, tool outputs
    turns: list[Turn] = field(default_factory=list)
    setup_s: float = 0.0  # before ``start``: its sandbox built and the task set up (older traces: 0)


@dataclass
class RunDir:
    path: Path
    config: dict
    metrics: list[dict]
    learner: list[Span]
    weight_syncs: list[Span]
    episodes: list[Episode]

    @property
    def schedule(self) -> str:
        return self.config["schedule"]["mode"]


def load_run(path: str | Path) -> RunDir:
    """A run directory; a clear :class:`ConfigError` when a file or the per-turn trace is missing."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"calibrate: {path} is not a run directory")
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise ConfigError(f"calibrate: {path} lacks {', '.join(missing)} (a finished `megathunder "
                          f"train` run writes {', '.join(REQUIRED_FILES)})")
    config = yaml.safe_load((path / "config.yaml").read_text())
    metrics = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    events = json.loads((path / "trace.json").read_text())["traceEvents"]
    run = RunDir(path, config, metrics, *_parse(events))
    if not metrics:
        raise ConfigError(f"calibrate: {path}/metrics.jsonl has no steps")
    if not run.episodes or not any(e.turns for e in run.episodes):
        raise ConfigError(f"calibrate: {path}/trace.json has no per-turn spans (process 'turns'); "
                          "it was written by an older megathunder: run it again")
    traced = {e.step for e in run.episodes}
    if not {r["step"] for r in metrics} <= traced:
        raise ConfigError(f"calibrate: {path}/trace.json covers steps {min(traced)}-"
                          f"{max(traced)} of {len(metrics)}: it keeps the last "
                          "run.timeline_steps steps of a run (and of a resumed run's last attempt); "
                          "calibrate a run whose trace covers it all")
    return run


def _parse(events: list[dict]) -> tuple[list[Span], list[Span], list[Episode]]:
    spans = [e for e in events if e.get("ph") == "X"]
    s = lambda e: Span(e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, e.get("args", {}).get("step", -1))  # noqa: E731
    learner = [s(e) for e in spans if e["pid"] == 0 and e["tid"] == 0]
    syncs = [s(e) for e in spans if e["pid"] == 0 and e["tid"] == 1]
    generated = [e for e in spans if e["pid"] == 1 and e["name"] == "generate+tools"]
    verified = [e for e in spans if e["pid"] == 1 and e["name"] == "verify"]
    episodes: list[Episode] = []
    for ep, verify in zip(generated, verified, strict=True):
        a = ep["args"]
        episodes.append(Episode(a["step"], a.get("group", -1), ep["ts"] / 1e6, (ep["ts"] + ep["dur"]) / 1e6,
                                (verify["ts"] + verify["dur"]) / 1e6, a.get("prompt_tokens", 0),
                                a.get("tokens", 0), setup_s=a.get("setup_s", 0.0)))
    for e in spans:
        if e["pid"] == 2 and e["name"] == "generate":
            episodes[e["tid"]].turns.append(Turn(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, e["args"]["tokens"]))
    return sorted(learner, key=lambda x: x.start), sorted(syncs, key=lambda x: x.start), episodes
