"""``megathunder eval-report``: runs of different schedules compared by score against cost.

Each run folder holds ``config.yaml`` and ``metrics.jsonl``: one JSON object per optimizer step
with at least ``step``, ``wall_s`` (cumulative seconds since the run's first step), ``gpu_hours``
(cumulative; on CPU, process-hours = wall_s * num_learner_procs / 3600) and ``schedule``; rows of
steps where periodic evaluation ran also carry ``eval/pass@1`` ... (and ``eval/pass@1_stderr``).

Outputs (the seed paper's Figure 5/6 form):

* ``score_vs_gpu_hours.png``: each run's score against GPU-hours (and against steps), one plot;
* ``time_to_score.csv`` / ``.md``: for each score the baseline run (the sync run unless
  ``--baseline``) reaches, the GPU-hours each run first reaches it at and the ratio
  baseline / run (above 1: the run needs fewer GPU-hours for the same score);
* ``report.json``: the curves and the table.

A threshold is the baseline's score at one of its evaluations; "first reaches" is the first
evaluation whose score is at least the threshold (no interpolation between evaluations). Scores
the baseline already has at zero cost (the starting model) give no ratio.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REQUIRED_KEYS = ("step", "wall_s", "gpu_hours", "schedule")


class ReportError(ValueError):
    pass


@dataclass
class RunCurve:
    name: str
    path: str
    schedule: str
    steps: list[int]
    wall_s: list[float]
    gpu_hours: list[float]
    scores: list[float]
    stderr: list[float | None]


def _schedule_from_config(path: Path) -> tuple[str, dict]:
    import yaml

    cfg_path = path / "config.yaml"
    if not cfg_path.is_file():
        raise ReportError(f"{path}: no config.yaml")
    try:
        cfg = yaml.safe_load(cfg_path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ReportError(f"{cfg_path}: not valid YAML ({err})") from None
    mode = (cfg.get("schedule") or {}).get("mode") if isinstance(cfg, dict) else None
    if not isinstance(mode, str):
        raise ReportError(f"{cfg_path}: no schedule.mode")
    return mode, cfg


def load_run(path: str | Path, metric: str = "eval/pass@1") -> tuple[RunCurve, dict]:
    """The evaluation rows of one run folder as a curve, and its config."""
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"{path}: no such run folder")
    schedule, cfg = _schedule_from_config(path)
    metrics_path = path / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ReportError(f"{path}: no metrics.jsonl")
    curve = RunCurve(path.name, str(path), schedule, [], [], [], [], [])
    last_hours = -math.inf
    for num, line in enumerate(metrics_path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{metrics_path}:{num}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ReportError(f"{where}: invalid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise ReportError(f"{where}: expected a JSON object")
        for key in REQUIRED_KEYS:
            if key not in row:
                raise ReportError(f"{where}: missing key {key!r}")
        if row["schedule"] != schedule:
            raise ReportError(
                f"{where}: schedule {row['schedule']!r} differs from config.yaml's {schedule!r}"
            )
        hours = row["gpu_hours"]
        if not isinstance(hours, int | float) or hours < last_hours:
            raise ReportError(f"{where}: gpu_hours must be a cumulative number, got {hours!r}")
        last_hours = hours
        if row.get(metric) is None:
            continue
        curve.steps.append(int(row["step"]))
        curve.wall_s.append(float(row["wall_s"]))
        curve.gpu_hours.append(float(hours))
        curve.scores.append(float(row[metric]))
        curve.stderr.append(row.get(f"{metric}_stderr"))
    if not curve.scores:
        raise ReportError(
            f"{metrics_path}: no rows with {metric!r} (was periodic evaluation on? eval.every_n_steps)"
        )
    return curve, cfg


def first_reaching(curve: RunCurve, threshold: float) -> int | None:
    """Index of the first evaluation with a score >= threshold."""
    return next((i for i, s in enumerate(curve.scores) if s >= threshold), None)


def time_to_score(baseline: RunCurve, run: RunCurve) -> list[dict]:
    """For each distinct score of the baseline, where each run first reaches it and the ratio."""
    rows = []
    for threshold in sorted(set(baseline.scores)):
        b = first_reaching(baseline, threshold)
        assert b is not None  # the threshold is one of the baseline's scores
        r = first_reaching(run, threshold)
        hb = baseline.gpu_hours[b]
        hr = None if r is None else run.gpu_hours[r]
        ratio = hb / hr if hr and hb > 0 else None
        wall_ratio = None
        if r is not None and baseline.wall_s[b] > 0 and run.wall_s[r] > 0:
            wall_ratio = baseline.wall_s[b] / run.wall_s[r]
        rows.append({
            "score": threshold, "run": run.name, "schedule": run.schedule,
            "baseline_step": baseline.steps[b], "baseline_gpu_hours": hb,
            "run_step": None if r is None else run.steps[r], "run_gpu_hours": hr,
            "gpu_hours_ratio": ratio, "wall_time_ratio": wall_ratio,
        })  # fmt: skip
    return rows


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(a) | set(b))
    out = []
    for key in keys:
        name = f"{prefix}{key}"
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _differences(va, vb, f"{name}.")
        elif va != vb:
            out.append(name)
    return out


IGNORED_DIFFERENCES = ("schedule.mode", "run.output_dir")


def plot(curves: list[RunCurve], metric: str, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_h, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2))
    for c in curves:
        label = f"{c.schedule} ({c.name})"
        (line,) = ax_h.plot(c.gpu_hours, c.scores, marker="o", label=label)
        ax_s.plot(c.steps, c.scores, marker="o", color=line.get_color(), label=label)
        stderr = [se for se in c.stderr if se is not None]
        if len(stderr) == len(c.stderr):
            lo = [s - se for s, se in zip(c.scores, stderr, strict=True)]
            hi = [s + se for s, se in zip(c.scores, stderr, strict=True)]
            ax_h.fill_between(c.gpu_hours, lo, hi, color=line.get_color(), alpha=0.15)
    ax_h.set_xlabel("GPU-hours (process-hours on CPU)")
    ax_s.set_xlabel("optimizer step")
    for ax in (ax_h, ax_s):
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    ax_h.legend()
    ax_h.set_title("score vs cost")
    ax_s.set_title("score vs step (same model, different cost)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def markdown_table(rows: list[dict], baseline: RunCurve) -> str:
    header = (
        f"| score | {baseline.schedule} GPU-h (step) | run | run GPU-h (step) | GPU-h ratio "
        "| wall ratio |"
    )
    lines = [header, "|---|---|---|---|---|---|"]
    for r in rows:
        run_at = "not reached" if r["run_step"] is None else (
            f"{r['run_gpu_hours']:.4g} ({r['run_step']})"
        )
        lines.append(
            f"| {r['score']:.3f} | {r['baseline_gpu_hours']:.4g} ({r['baseline_step']}) | "
            f"{r['schedule']} ({r['run']}) | {run_at} | {_fmt(r['gpu_hours_ratio'], '.2f')} | "
            f"{_fmt(r['wall_time_ratio'], '.2f')} |"
        )
    return "\n".join(lines)


def build_report(run_dirs: list[str], out_dir: str | Path, metric: str = "eval/pass@1",
                 baseline: str | None = None) -> dict:
    """Read the runs, write the PNG, CSV, Markdown and JSON into ``out_dir``; return the JSON."""
    if len(run_dirs) < 2:
        raise ReportError("eval-report compares runs: give at least two RUN_DIRs")
    loaded = [load_run(d, metric) for d in run_dirs]
    curves = [c for c, _ in loaded]
    if baseline is not None:
        base_idx = [i for i, d in enumerate(run_dirs) if Path(d) == Path(baseline)]
        if not base_idx:
            raise ReportError(f"--baseline {baseline}: not one of the RUN_DIRs")
    else:
        base_idx = [i for i, c in enumerate(curves) if c.schedule == "sync"]
        if len(base_idx) != 1:
            raise ReportError(
                f"{len(base_idx)} runs with schedule sync; name the one to compare against "
                "with --baseline"
            )
    b = base_idx[0]
    base = curves[b]
    warnings = []
    for (c, cfg), d in zip(loaded, run_dirs, strict=True):
        diff = [k for k in _differences(loaded[b][1], cfg) if k not in IGNORED_DIFFERENCES]
        if diff and c is not base:
            warnings.append(f"{d}: config differs from the baseline's beyond the schedule: {diff[:8]}")
    rows = [row for i, c in enumerate(curves) if i != b for row in time_to_score(base, c)]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot(curves, metric, out / "score_vs_gpu_hours.png")
    with open(out / "time_to_score.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["score"])
        writer.writeheader()
        writer.writerows(rows)
    table = markdown_table(rows, base)
    (out / "time_to_score.md").write_text(f"{metric}, baseline {base.name}\n\n{table}\n")
    report = {
        "metric": metric,
        "baseline": base.name,
        "runs": [asdict(c) for c in curves],
        "time_to_score": rows,
        "warnings": warnings,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    report["table"] = table
    return report


def run(args) -> int:
    try:
        report = build_report(args.run_dirs, args.out, args.metric, args.baseline)
    except ReportError as err:
        print(f"megathunder eval-report: {err}", file=sys.stderr)
        return 2
    for w in report["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    print(report["table"])
    print(f"wrote {Path(args.out) / 'score_vs_gpu_hours.png'}, time_to_score.csv/.md, report.json")
    return 0
