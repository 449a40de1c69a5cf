"""``megathunder bench learning``: the paper's claims measured as the paper states them -- the same
score in less time than sync, and at a fixed budget a better score than the stale schedules.

    megathunder bench learning CONFIG --out DIR [--schedules sync thunder async fully_async]
        [--seeds 0 1 2] [--tool-latency S] [--verifier-latency S] [key=value ...]

One ``megathunder train`` per schedule and seed (``python -m megathunder.bench.bench_train`` with the
workload's stand-in latencies), in ``DIR/SCHEDULE/seedK``, one after the other. Resumable: a run
with a ``summary.json`` is done and kept; an unfinished one resumes from its last checkpoint (the
same command, ``run.resume``); so a stopped invocation continues where it was, and a set too long
for one sitting finishes across several. ``--out results/learning/SET`` keeps a set across
machines: ``results/.gitignore`` lets git see only each run's ``metrics.jsonl``, ``summary.json``
and ``config.yaml`` (all the report reads) and the report, so committed finished runs are kept on
the next machine and the rest is run there.

The clock of every run starts at its first step (``wall_s``; what comes before -- loading, the first
push, the evaluation before RL -- is ``setup_s``, reported apart): time to a score compares runs
like with like, not a cold first run's caches. Evaluations are off the clock too: each one's own
seconds (``eval/wall_s``) are taken off every later row (``training_clock``), and while it runs no
training episode starts a turn (``AgentLoop.pause``: async's next batch waits), so no schedule
trains during them; on a short run an evaluation takes as long as several steps and would pull
every ratio towards 1. Process-hours are that time x learner processes (GPU-hours on GPUs).

Report (``DIR/learning.json``, ``learning.md``, ``learning.png``), reusing ``eval-report``'s curves:

- **time to score** (the claim "the same score, faster"): per seed k, for each score sync seed k
  reaches at an evaluation (above its score before RL), the wall time each schedule's seed k first
  reaches it; the seed's ratio is sync's time over the schedule's, the geometric mean over those
  scores; across seeds the mean with a 95% interval (Student's t over the seeds). Since thunder's
  updates equal sync's, its expected ratio is its steps-per-hour ratio.
- **at a fixed budget** (the claim "better than async at the same cost"): the budget is the
  shortest run's training time over every run (or ``--budget-s``); each run's score is its last
  evaluation within it; per schedule the mean over seeds with its standard error, and each
  schedule's difference to thunder with a 95% interval (paired by seed); and pass@1..k (``eval.k``)
  at that evaluation, per schedule the mean over seeds with its standard error. A run with no
  evaluation after RL within the budget (a slow schedule whose first one comes later) is left out
  of these, and the report counts the seeds that had one: evaluate often enough that every run has
  one (``eval.every_n_steps``).
- **staleness**: the mean and largest policy lag each schedule trained on.
- **the picture**: score against wall time and against process-hours, one line per schedule (the
  mean over seeds at each evaluation) with the seeds' range as a band.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megathunder.config import SCHEDULE_MODES
from megathunder.eval.cost_report import RunCurve, first_reaching, load_run

PASS_AT = re.compile(r"eval/pass@\d+")

T_95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
"""Student's t two-sided 95% quantile by degrees of freedom (more: 1.96)."""

STYLES = {"sync": ("--", "o"), "thunder": ("-", "s"), "async": ("-.", "^"), "fully_async": (":", "D")}
"""Line style and marker per schedule in the picture."""


@dataclass
class Run:
    """One finished run of the set: its evaluation curve, staleness and speed."""

    schedule: str
    seed: int
    curve: RunCurve
    lag_mean: float = math.nan
    lag_max: int = 0
    steps_per_hour: float = math.nan
    before: float | None = None  # held-out score before RL
    evals: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # (wall_s, pass@1..k) per evaluation


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% interval (Student's t over ``values``; nan for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    t = T_95.get(len(values) - 1, 1.96)
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def run_dir(root: Path, schedule: str, seed: int) -> Path:
    return root / schedule / f"seed{seed}"


def train(config: str, out: Path, seed: int, schedule: str, knobs: list[str], overrides: list[str],
          timeout_s: float) -> None:
    """One run (a finished one is kept; an unfinished one resumes from its checkpoint)."""
    if (out / "summary.json").is_file():
        return
    cmd = [sys.executable, "-m", "megathunder.bench.bench_train", *knobs, config, f"run.output_dir={out}",
           f"run.seed={seed}", f"schedule.mode={schedule}", "run.resume=true", "run.progress=false", *overrides]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TORCHDYNAMO_DISABLE": "1", "MEGATHUNDER_SUPERVISE": "0"}
    out.mkdir(parents=True, exist_ok=True)
    log = out / "train.log"
    code = run_logged(cmd, env, log, timeout_s)
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({code}; -9: killed, e.g. by the OOM killer):\n"
                           f"{log.read_text(errors='replace')[-4000:]}")


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float) -> int:
    """Run ``cmd`` in a session of its own, its output into ``log``; when it ends (or runs past
    ``timeout_s``), whatever it left behind in that session goes too. Its exit code (-N: signal N).

    Not a pipe: a run killed outright (the OOM killer) leaves its engine's processes holding any
    pipe it was given, and a reader would wait on them forever."""
    with log.open("ab") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{' '.join(cmd)} ran past {timeout_s:.0f} s; its log: {log}") from None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def correction(args: argparse.Namespace, schedule: str) -> list[str]:
    """The off-policy correction a stale schedule needs where the config sets none: async and
    fully_async train on older policies' samples and are refused without one, so they run with
    token-level TIS (``objective.tis=token``); sync and thunder, on-policy, run the config as it is."""
    if schedule in ("sync", "thunder"):
        return []
    from megathunder.config import load_config

    cfg = load_config(args.config, [*args.overrides, f"schedule.mode={schedule}",
                                    "objective.allow_uncorrected_off_policy=true"])
    obj = cfg.objective
    if getattr(obj, "tis", "none") != "none" or getattr(obj, "ppo_old_logprobs", None) == "rollout":
        return []
    return ["objective.tis=token"]


def load(out: Path, schedule: str, seed: int, metric: str) -> Run:
    """A finished run's curve, staleness and speed."""
    curve, _ = load_run(out, metric)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_s = training_clock(rows)
    at = {r["step"]: (t, r["wall_s"]) for r, t in zip(rows, train_s, strict=True)}
    curve.gpu_hours = [h * at[k][0] / at[k][1] if at[k][1] > 0 else h
                       for k, h in zip(curve.steps, curve.gpu_hours, strict=True)]
    curve.wall_s = [at[k][0] for k in curve.steps]
    lags = [r["policy_lag_mean"] for r in rows]
    summary = json.loads((out / "summary.json").read_text())
    run = Run(schedule, seed, curve, statistics.fmean(lags), max(r["policy_lag_max"] for r in rows))
    run.steps_per_hour = 3600 * len(rows) / train_s[-1] if train_s[-1] > 0 else math.nan
    run.before = summary.get("eval_pass@1_before_rl")
    run.evals = [(t, {k: v for k, v in r.items() if PASS_AT.fullmatch(k)})
                 for r, t in zip(rows, train_s, strict=True) if metric in r]
    return run


def training_clock(rows: list[dict]) -> list[float]:
    """Each row's ``wall_s`` less the seconds of the evaluations before it (``eval/wall_s``; a row's
    clock is read before its own evaluation runs): the run's training time, which no evaluation
    dilutes (module docstring)."""
    out, evals = [], 0.0
    for r in rows:
        out.append(r["wall_s"] - evals)
        evals += float(r.get("eval/wall_s", 0.0))
    return out


def pass_at_budget(runs: list[Run], budget_s: float) -> dict[str, tuple[float, float]]:
    """pass@1..k at the budget: each run's last evaluation within it, the mean over runs and its
    standard error (nan for one run), per k every run evaluated."""
    last = [[figures for wall, figures in r.evals if wall <= budget_s] for r in runs]
    at = [evals[-1] for evals in last if evals]
    if not at:
        return {}
    keys = sorted(set.intersection(*(set(a) for a in at)), key=lambda k: int(k.rsplit("@", 1)[1]))
    out = {}
    for key in keys:
        values = [a[key] for a in at]
        se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
        out[key.removeprefix("eval/")] = (statistics.fmean(values), se)
    return out


def time_ratio(sync: RunCurve, other: RunCurve, before: float | None) -> tuple[float | None, int, int]:
    """The geometric mean over the scores sync reaches (above ``before``) of sync's wall time to
    reach each over ``other``'s; and how many such scores ``other`` reached, of how many."""
    thresholds = sorted({s for s in sync.scores if before is None or s > before})
    logs = []
    for t in thresholds:
        i, j = first_reaching(sync, t), first_reaching(other, t)
        if i is None or j is None or sync.wall_s[i] <= 0 or other.wall_s[j] <= 0:
            continue
        logs.append(math.log(sync.wall_s[i] / other.wall_s[j]))
    return (math.exp(statistics.fmean(logs)) if logs else None), len(logs), len(thresholds)


def score_at(curve: RunCurve, budget_s: float) -> float | None:
    """The run's score at its last evaluation within ``budget_s`` of wall time."""
    within = [s for s, w in zip(curve.scores, curve.wall_s, strict=True) if w <= budget_s]
    return within[-1] if within else None


def report(runs: list[Run], budget_s: float | None = None) -> dict:
    """The figures of the module docstring, from finished runs."""
    by = {(r.schedule, r.seed): r for r in runs}
    schedules = sorted({r.schedule for r in runs}, key=lambda s: SCHEDULE_MODES.index(s))
    seeds = sorted({r.seed for r in runs})
    if budget_s is None:
        budget_s = min(r.curve.wall_s[-1] for r in runs)
    out: dict = {"seeds": seeds, "budget_s": budget_s, "schedules": {}}
    for s in schedules:
        mine = [by[(s, k)] for k in seeds if (s, k) in by]
        row: dict = {
            "runs": len(mine),
            "steps_per_hour": interval([r.steps_per_hour for r in mine]),
            "policy_lag_mean": statistics.fmean(r.lag_mean for r in mine),
            "policy_lag_max": max(r.lag_max for r in mine),
        }
        at_budget = [score_at(r.curve, budget_s) for r in mine]
        scores = [x for x in at_budget if x is not None]
        row["evaluated_at_budget"] = f"{len(scores)}/{len(mine)}"  # a slow run may have no evaluation by then
        if scores:
            mean = statistics.fmean(scores)
            se = statistics.stdev(scores) / math.sqrt(len(scores)) if len(scores) > 1 else math.nan
            row["score_at_budget"] = (mean, se)
        row["pass_at_budget"] = pass_at_budget(mine, budget_s)
        if s != "sync" and all(("sync", k) in by for k in seeds):
            ratios, reached, total = [], 0, 0
            for k in seeds:
                if (s, k) not in by:
                    continue
                sync = by[("sync", k)]
                ratio, n, m = time_ratio(sync.curve, by[(s, k)].curve, sync.before)
                reached, total = reached + n, total + m
                if ratio is not None:
                    ratios.append(ratio)
            if ratios:
                row["time_to_score_vs_sync"] = interval(ratios)
            row["scores_reached"] = f"{reached}/{total}"
        out["schedules"][s] = row
    if "thunder" in out["schedules"]:
        for s in schedules:
            if s == "thunder":
                continue
            diffs = []
            for k in seeds:
                a, b = by.get((s, k)), by.get(("thunder", k))
                if a is None or b is None:
                    continue
                x, y = score_at(a.curve, budget_s), score_at(b.curve, budget_s)
                if x is not None and y is not None:
                    diffs.append(y - x)
            if diffs:
                out["schedules"][s]["thunder_minus_this_at_budget"] = interval(diffs)
    return out


def markdown(result: dict) -> str:
    def fmt(pair) -> str:
        mean, half = pair
        return f"{mean:.3f}" + ("" if math.isnan(half) else f" ± {half:.3f}")

    lines = [f"seeds {result['seeds']}; budget {result['budget_s']:.0f} s of training time", "",
             "| schedule | steps/h | time to sync's scores (sync / this) | scores reached | score at budget "
             "| seeds evaluated by the budget | thunder - this at budget | policy lag mean / max |",
             "|---|---|---|---|---|---|---|---|"]
    for s, row in result["schedules"].items():
        lines.append(
            f"| {s} | {fmt(row['steps_per_hour'])} | "
            f"{fmt(row['time_to_score_vs_sync']) if 'time_to_score_vs_sync' in row else '--'} | "
            f"{row.get('scores_reached', '--')} | "
            f"{fmt(row['score_at_budget']) if 'score_at_budget' in row else '--'} | {row['evaluated_at_budget']} | "
            f"{fmt(row['thunder_minus_this_at_budget']) if 'thunder_minus_this_at_budget' in row else '--'} | "
            f"{row['policy_lag_mean']:.2f} / {row['policy_lag_max']} |")
    ks = sorted({k for row in result["schedules"].values() for k in row.get("pass_at_budget", {})},
                key=lambda k: int(k.rsplit("@", 1)[1]))
    if ks:
        lines += ["", "pass@k at the budget (mean over seeds ± its standard error):", "",
                  "| schedule | " + " | ".join(ks) + " |", "|---|" + "---|" * len(ks)]
        for s, row in result["schedules"].items():
            got = row.get("pass_at_budget", {})
            lines.append(f"| {s} | " + " | ".join(fmt(got[k]) if k in got else "--" for k in ks) + " |")
    lines.append("")
    lines.append("± : 95% interval over seeds (Student's t); score and pass@k at budget: mean ± its standard error.")
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], path: Path, title: str) -> None:
    """Score against wall time and against process-hours: per schedule the mean over seeds at each
    evaluation, the seeds' range as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    schedules = sorted({r.schedule for r in runs}, key=lambda s: SCHEDULE_MODES.index(s))
    for s in schedules:
        own = [r for r in runs if r.schedule == s]
        mine = [r.curve for r in own]
        n = min(len(c.scores) for c in mine)
        start = [r.before for r in own if r.before is not None]  # the warm-started model, at cost 0
        for ax, xs in ((axes[0], [c.wall_s for c in mine]), (axes[1], [c.gpu_hours for c in mine])):
            x = [statistics.fmean(v[i] for v in xs) for i in range(n)]
            ys = [[c.scores[i] for c in mine] for i in range(n)]
            if len(start) == len(own):
                x, ys = [0.0, *x], [start, *ys]
            style = STYLES.get(s, ("-", "o"))  # distinct marks: thunder's curve can lie on sync's
            seeds = f"{len(mine)} seed" + "s" * (len(mine) != 1)
            line, = ax.plot(x, [statistics.fmean(y) for y in ys], linestyle=style[0], marker=style[1],
                            markersize=9 if s == "sync" else 5, label=f"{s} ({seeds})")
            ax.fill_between(x, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.2)
    axes[0].set_xlabel("training time from the first step, evaluations excluded (s)")
    axes[1].set_xlabel("learner process-hours (GPU-hours on GPUs)")
    for ax in axes:
        ax.set_ylabel("held-out pass@1")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megathunder bench learning", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--out", required=True, help="the set's directory (a rerun continues it)")
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULE_MODES), choices=SCHEDULE_MODES)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--tool-latency", type=float, default=0.0, help="seconds added to every tool call")
    p.add_argument("--verifier-latency", type=float, default=0.0, help="seconds added before every reward")
    p.add_argument("--budget-s", type=float, default=None, help="the fixed budget (default: the shortest run)")
    p.add_argument("--metric", default="eval/pass@1")
    p.add_argument("--run-timeout-s", type=float, default=6 * 3600)
    p.add_argument("--report-only", action="store_true", help="report the finished runs, train nothing")
    args = p.parse_args(argv)
    root = Path(args.out)
    knobs = [f"--tool-latency={args.tool_latency}", f"--verifier-latency={args.verifier_latency}"]
    runs = []
    for seed in args.seeds:  # seed by seed: an interrupted set still has whole seeds to compare
        for schedule in args.schedules:
            out = run_dir(root, schedule, seed)
            if not args.report_only:
                print(f"bench learning: {schedule} seed {seed} -> {out}", flush=True)
                train(args.config, out, seed, schedule, knobs, [*args.overrides, *correction(args, schedule)],
                      args.run_timeout_s)
            if (out / "summary.json").is_file():
                runs.append(load(out, schedule, seed, args.metric))
    if not runs:
        print("bench learning: no finished run", file=sys.stderr)
        return 1
    result = report(runs, args.budget_s)
    (root / "learning.json").write_text(json.dumps(result, indent=2) + "\n")
    (root / "learning.md").write_text(markdown(result))
    plot(runs, root / "learning.png", f"{Path(args.config).stem}: {len({r.seed for r in runs})} seeds")
    print(markdown(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
