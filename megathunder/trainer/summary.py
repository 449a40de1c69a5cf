"""The run's summary: ``summary.json`` and the table printed at the end of ``megathunder train``."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

log = logging.getLogger(__name__)


def write_summary(out: Path, rows: list[dict], setup_s: float | None = None, extra: dict | None = None) -> dict:
    """``setup_s``: this invocation's seconds before its first step (not in ``wall_s``); ``extra``:
    more of the run's figures (the sandbox servers' episode counts)."""
    k = max(1, len(rows) // 5)
    mean = lambda key, rs: sum(r[key] for r in rs) / max(len(rs), 1)  # noqa: E731
    summary = {
        "schedule": rows[-1]["schedule"] if rows else None,
        "steps": len(rows),
        "reward_first_steps": round(mean("reward_mean", rows[:k]), 4),
        "reward_last_steps": round(mean("reward_mean", rows[-k:]), 4),
        "mean_step_s": round(mean("step_s", rows), 3),
        "learner_idle_share": round(mean("learner_idle_share", rows), 4),
        "max_policy_lag": max((r["policy_lag_max"] for r in rows), default=0),
        "max_probe_gap": max((r["probe_gap"] for r in rows if not math.isnan(r["probe_gap"])), default=float("nan")),
        "mean_backward_after_last_reward": round(mean("backward_after_last_reward", rows), 3),
        "wall_s": round(rows[-1]["wall_s"], 1) if rows else 0.0,  # from the first step
        **({} if setup_s is None else {"setup_s": round(setup_s, 1)}),
    }
    for key in ("opd/reverse_kl", "opd/gjsd"):
        if rows and key in rows[0]:
            summary[f"{key}_first_steps"] = round(mean(key, rows[:k]), 4)
            summary[f"{key}_last_steps"] = round(mean(key, rows[-k:]), 4)
    summary.update(held_out(out, rows))
    summary.update(extra or {})
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def held_out(out: Path, rows: list[dict]) -> dict:
    """Held-out pass@1 before RL (``eval_before.json``: the warm-started model) and at the last
    evaluation, each with its standard error over the problems, and the gain in standard errors of
    the difference (the two estimates taken as independent: conservative, the problems are the same)."""
    evals = [r for r in rows if "eval/pass@1" in r]
    before = json.loads((out / "eval_before.json").read_text()) if (out / "eval_before.json").is_file() else {}
    figures: dict = {}
    if "eval/pass@1" in before:
        figures["eval_pass@1_before_rl"] = round(before["eval/pass@1"], 4)
        figures["eval_pass@1_before_rl_stderr"] = round(before.get("eval/pass@1_stderr", float("nan")), 4)
    if evals:
        last = evals[-1]
        figures["eval_pass@1_first"] = round(evals[0]["eval/pass@1"], 4)
        figures["eval_pass@1_last"] = round(last["eval/pass@1"], 4)
        figures["eval_pass@1_last_stderr"] = round(last.get("eval/pass@1_stderr", float("nan")), 4)
    if "eval/pass@1" in before and evals:
        gain = evals[-1]["eval/pass@1"] - before["eval/pass@1"]
        se = math.hypot(before.get("eval/pass@1_stderr", math.nan), evals[-1].get("eval/pass@1_stderr", math.nan))
        figures["eval_pass@1_gain"] = round(gain, 4)
        figures["eval_pass@1_gain_in_stderrs"] = round(gain / se, 2) if se > 0 else float("nan")
    return figures


def print_summary(summary: dict, out: Path) -> None:
    print(f"\n{'metric':<34} value")
    for key, value in summary.items():
        print(f"{key:<34} {value:.4g}" if isinstance(value, float) else f"{key:<34} {value}")
    print(f"run directory: {out}  (metrics.jsonl, journal.jsonl, timeline.png, trace.json, checkpoints/)")
    if summary.get("schedule") in ("sync", "thunder"):
        print(f"this run replayed under sync and thunder: megathunder simulate --calibrate {out}")
    print(json.dumps(summary))
