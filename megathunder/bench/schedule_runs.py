"""``megathunder bench schedules``: one workload under all four schedules, in one invocation.

Each schedule runs as its own ``megathunder train`` (fresh process, same config, same warm-started
model), one after the other on the same machine. Workloads:

- ``quickstart``: the arithmetic quickstart (one turn, no tools, instant verifier);
- ``tools``: the multi-turn calculator task with ``--tool-latency`` seconds per tool call and
  ``--verifier-latency`` seconds per reward (stand-ins for sandboxes and test suites);
- ``verifier``: the quickstart's task with ``--slow-verifier-latency`` seconds per reward (default
  3 s, like a test suite): the verifier, not generation or the learner, sets the pace;
- ``swe_local``: the shipped SWE-style set in the local sandbox, real tools and the SWE-bench
  grading (with ``--config configs/swe_local.yaml``, which sets its limits).

Per schedule (medians over the steps after the first, which pays one-off costs; the figures in
earlier runs took means over every step): wall time per optimizer step, learner
idle share, steps per hour, and every schedule's ratio to sync in steps per hour, with sync's
zero-staleness overlap bound B = step / (step - learner busy). ``--ablate NAME ...`` adds one
thunder run per name with that mechanism switched off (``ABLATIONS``), in the same invocation, so
each one's gain is measured against the same sync run. The first schedule's run does the SFT warm
start; the others start from its result. ``--out DIR`` keeps every run directory
(``DIR/WORKLOAD/SCHEDULE``: metrics, trace, journal), e.g. for ``megathunder simulate --calibrate``.

``--rounds N`` runs the whole set N times (``DIR/WORKLOAD/roundR/SCHEDULE``), every other round in
reverse order so that a machine drifting during the invocation favours no schedule; each ratio is
then the median of its N per-round ratios (each round's runs against that round's sync): on a
shared machine one invocation's ratio moves by several points from the next one's.

``--paired`` adds one thunder run with ``bench_train --paired`` (sync's path at even steps,
thunder's at odd ones): thunder/sync from the steps of that one run, the median over pairs (step
2k's sync path against step 2k + 1's thunder path; the first pair left out) of sync's step time
over thunder's. The two paths then meet the same machine minutes apart at most a step, where
separate runs meet its drift: on this project's shared 2-core machine two runs of one schedule
differ by up to 15%, more than the difference being measured on the quickstart. The paired run's
steps are also cut into phases from its ``trace.json`` (``step_phases``: before the first request,
the rollout, the verifiers after it, the wait for the gradient call, the call) and the report gives
thunder's time minus sync's in each, the median over the same pairs: where a change to either
schedule wins or loses, to ~1 ms, when the step times alone move by more than that. Sync's own time
in each goes beside them, and its arrival window (the first episode's end to the last's): a split of
the gradient pass can only win when that window is longer than one learner call's fixed cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from megathunder.config import SCHEDULE_MODES

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = SCHEDULE_MODES
WORKLOADS = {
    "quickstart": ["task.name=arithmetic", "agent.max_turns=1"],
    "tools": ["task.name=calculator", "task.max_operand=9", "agent.max_turns=5", "agent.max_new_tokens_per_turn=40",
              "agent.max_total_tokens=800", "rollout.engine.max_model_len=1024"],
    "verifier": ["task.name=arithmetic", "agent.max_turns=1"],
    "swe_local": ["task.name=swe_local"],
}


ABLATIONS = {  # thunder with one mechanism off (the run's own overrides set them on)
    "priority": ["rollout.engine.scheduling=fifo"],
    "packing": ["ledger.pack_ready_work=false"],
    "pending": ["ledger.max_pending=0", "ledger.per_turn_scores=off"],  # per-turn scores fill pending buffers
    "per_turn": ["ledger.per_turn_scores=off"],
    "hold": ["ledger.hold_while_generating=never"],
    "defer": ["ledger.defer_uniform_groups=false"],
    "skip_zero": ["objective.skip_zero_advantage=false"],  # thunder's own (sync keeps skipping)
    "tail": ["probe.overlap=false"],  # sync keeps it: the probe is ours, not sync's algorithm
}


def _latencies(name: str, args) -> tuple[float, float]:
    """(tool, verifier) seconds added to every call on workload ``name``."""
    if name == "tools":
        return args.tool_latency, args.verifier_latency
    if name == "verifier":
        return 0.0, args.slow_verifier_latency
    return 0.0, 0.0


def _train(config: str, out: Path, overrides: list[str], knobs: tuple[str, ...] | list[str] = ()) -> dict:
    """One run of ``megathunder train`` with the benchmark's ``knobs`` installed (``bench_train``)."""
    cmd = [sys.executable, "-m", "megathunder.bench.bench_train", *knobs, config, f"run.output_dir={out}", *overrides]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return json.loads((out / "summary.json").read_text())


def run_workload(name: str, args, root: Path) -> dict:
    """Every schedule (and ablation) of workload ``name``, ``args.rounds`` times; per label its
    figures, and with sync its ratios to sync (the medians over rounds when there are several)."""
    tool_s, verifier_s = _latencies(name, args)
    common = [*WORKLOADS[name], f"run.num_steps={args.steps}", "run.progress=false", "run.wandb=disabled",
              "run.checkpoint_every=0", "objective.tis=token", "eval.every_n_steps=0",
              f"batch.num_prompts_per_batch={args.prompts}", f"batch.samples_per_prompt={args.samples}",
              *args.overrides]
    warm = [f"sft.num_steps={args.sft_steps}"]
    latency = [f"--tool-latency={tool_s}", f"--verifier-latency={verifier_s}"]
    runs: list[tuple[str, str, list[str]]] = [(s, s, []) for s in args.schedules]  # (label, schedule, overrides)
    runs += [(f"thunder-no_{a}", "thunder", ABLATIONS[a]) for a in args.ablate]
    if args.paired:
        runs.append(("paired", "thunder", ["--paired"]))
    rounds = args.rounds
    per_round, first = [], True
    for r in range(rounds):
        results = {}
        for label, schedule, ablation in alternate(runs, r):
            out = root / name / label if rounds == 1 else root / name / f"round{r}" / label
            knobs = [*latency, *(a for a in ablation if a.startswith("--"))]
            overrides = [*common, *warm, f"schedule.mode={schedule}", *(a for a in ablation if not a.startswith("--"))]
            summary = _train(args.config, out, overrides, knobs)
            if first:  # the others start from this run's model (none built here: the configured one)
                first = False
                model = out / ("sft_model" if args.sft_steps else "init_model")
                warm = [f"learner.model.hf_checkpoint={model}"] if model.is_dir() else []
                warm.append("sft.num_steps=0")
            if label == "paired":
                figures = paired(out / "metrics.jsonl")
                if (out / "trace.json").is_file():
                    figures.update(paired_phases(out / "metrics.jsonl", out / "trace.json"))
                step_s, idle = figures["thunder_step_s"], figures["thunder_idle_share"]
            else:
                figures = {}
                step_s, idle = steady_state(out / "metrics.jsonl")
            results[label] = {
                "step_s": step_s,
                "learner_idle_share": idle,
                "steps_per_hour": 3600.0 / step_s,
                "max_policy_lag": summary["max_policy_lag"],
                "reward_last_steps": summary["reward_last_steps"],
                **figures,
            }
            print(f"  {name:<10} {label:<11} {step_s:7.2f} s/step  idle {idle:5.1%}  "
                  f"{3600 / step_s:7.0f} steps/h  lag {summary['max_policy_lag']}"
                  + (f"  (thunder's steps; sync's {figures['sync_step_s']:.2f} s/step)" if figures else "")
                  + (f"  (round {r})" if rounds > 1 else ""), flush=True)
        per_round.append(vs_sync(results))
    return per_round[0] if rounds == 1 else median_of_rounds(per_round)


def step_rows(metrics: Path) -> list[dict]:
    """A run's ``metrics.jsonl`` rows of optimizer steps (evaluation-only rows left out)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in rows if "step_s" in r]


def steady_state(metrics: Path) -> tuple[float, float]:
    """A run's step time and learner idle share, each its median over the steps after the first."""
    rows = step_rows(metrics)
    return (median_after_first([r["step_s"] for r in rows]),
            median_after_first([r["learner_idle_share"] for r in rows]))


def paired(metrics: Path) -> dict[str, float]:
    """A paired run (``bench_train --paired``)'s figures: each path's median step time (and thunder's
    learner idle share) and ``paired_vs_sync``, the median over pairs of sync's step time over the
    next step's, thunder's (steps per hour, thunder over sync), over ``compared_pairs``."""
    pairs = compared_pairs(step_rows(metrics))
    if not pairs:
        raise ValueError(f"{metrics}: no sync step followed by a thunder step (bench_train --paired, >= 2 steps)")
    return {
        "sync_step_s": statistics.median(a["step_s"] for a, _ in pairs),
        "thunder_step_s": statistics.median(b["step_s"] for _, b in pairs),
        "thunder_idle_share": statistics.median(b["learner_idle_share"] for _, b in pairs),
        "paired_vs_sync": statistics.median(a["step_s"] / b["step_s"] for a, b in pairs),
        "pairs": len(pairs),
    }


def compared_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """The (sync step, next thunder step) row pairs of a paired run that its figures compare: the
    first left out, as the first step elsewhere, unless it is the only one."""
    pairs = [(a, b) for a, b in zip(rows, rows[1:]) if a.get("schedule") == "sync" and b.get("schedule") == "thunder"]
    return pairs[1:] or pairs


PHASES = {  # step_phases' names, as the report prints them
    "before_requests": "before the first request",
    "rollout": "rollout",
    "verifiers_after": "verifiers after it",
    "to_gradient": "last reward to the gradient call",
    "gradient": "gradient call",
}
ANSWERS = "answers"
"""``step_phases``' one figure beside the phases, the end of ``rollout`` from the first episode's
end to the last's: the arrival window, the only part of the rollout that a finished trajectory's
gradient can overlap."""


def step_phases(trace: Path) -> dict[int, dict[str, float]]:
    """Each optimizer step of a sync or thunder run, cut into phases (seconds) from its ``trace.json``:
    ``before_requests`` from the previous step's gradient call (``close``) ending to the step's
    first request (the previous step's optimizer step, weight push and the probe's vLLM part);
    ``rollout`` from there to the last episode's end; ``verifiers_after`` to the last verifier's end
    after that; ``to_gradient`` to the start of the gradient call (sync sends the batch's events
    then; thunder only the last ones); ``gradient``, the call. They add up to the time between the
    two steps' gradient calls ending. Beside them, ``answers`` (``ANSWERS``): the end of ``rollout``
    from the first episode's end. Steps whose previous call or episodes the trace does
    not hold (its first, or older than ``run.timeline_steps``) are left out."""
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    closes: dict[int, tuple[float, float]] = {}
    episodes: dict[int, list[tuple[float, float]]] = defaultdict(list)
    verifies: list[tuple[float, float]] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        where, start, end = names.get(e["pid"]), e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
        if where == "learner" and e["name"] == "close":
            closes[e["args"]["step"]] = (start, end)
        elif where == "rollout" and e["name"] == "generate+tools":
            episodes[e["args"]["step"]].append((start, end))
        elif where == "rollout" and e["name"] == "verify":
            verifies.append((start, end))
    phases = {}
    for step, (call_start, call_end) in sorted(closes.items()):
        if step - 1 not in closes or not episodes.get(step):
            continue
        first = min(start for start, _ in episodes[step])
        first_end, last = min(end for _, end in episodes[step]), max(end for _, end in episodes[step])
        verified = max([last, *(end for start, end in verifies if first <= start < call_start)])
        phases[step] = {"before_requests": first - closes[step - 1][1], "rollout": last - first,
                        "verifiers_after": verified - last, "to_gradient": call_start - verified,
                        "gradient": call_end - call_start, ANSWERS: last - first_end}
    return phases


def paired_phases(metrics: Path, trace: Path) -> dict[str, float]:
    """A paired run (``bench_train --paired``): per phase (``step_phases``), ``phase_<name>_ms``, the median
    over the pairs ``paired`` compares (``compared_pairs``) of thunder's time in it minus sync's, in
    milliseconds, and ``sync_<name>_ms``, sync's own time in it over the same pairs (the scale of the
    differences), ``answers`` too. Pairs the trace does not cover are left out; none left: no figures."""
    phases = step_phases(trace)
    pairs = [(a["step"], b["step"]) for a, b in compared_pairs(step_rows(metrics))]
    pairs = [(a, b) for a, b in pairs if a in phases and b in phases]
    if not pairs:
        return {}
    figures = {f"phase_{name}_ms": 1e3 * statistics.median(phases[b][name] - phases[a][name] for a, b in pairs)
               for name in PHASES}
    figures.update({f"sync_{name}_ms": 1e3 * statistics.median(phases[a][name] for a, _ in pairs)
                    for name in (*PHASES, ANSWERS)})
    return figures


def median_after_first(values: list[float]) -> float:
    """The median over every step but the first, which pays one-off costs (vLLM's first batch,
    allocator warm-up); a one-step run's own value."""
    return statistics.median(values[1:] if len(values) > 1 else values)


def alternate(runs: list, r: int) -> list:
    """Round ``r``'s order: as given in even rounds, reversed in odd ones."""
    return list(runs) if r % 2 == 0 else list(reversed(runs))


def vs_sync(results: dict[str, dict]) -> dict[str, dict]:
    """Each run's ratio to sync in steps per hour and its share of sync's overlap bound B (in place)."""
    if "sync" in results:
        sync = results["sync"]
        busy = (1.0 - sync["learner_idle_share"]) * sync["step_s"]
        bound = sync["step_s"] / max(sync["step_s"] - busy, busy)  # (W + T) / max(W, T), W = step - T
        for r in results.values():
            r["vs_sync"] = r["steps_per_hour"] / sync["steps_per_hour"]
            r["of_bound"] = r["vs_sync"] / bound
        sync["bound"] = bound
    return results


def median_of_rounds(per_round: list[dict[str, dict]]) -> dict[str, dict]:
    """Per label the median of every figure over the rounds (the largest policy lag), with the
    per-round ratios to sync kept as ``rounds_vs_sync``."""
    merged: dict[str, dict] = {}
    for label in per_round[0]:
        rows = [results[label] for results in per_round]
        merged[label] = {key: (max(row[key] for row in rows) if key == "max_policy_lag"
                               else statistics.median(row[key] for row in rows)) for key in rows[0]}
        if "vs_sync" in rows[0]:
            merged[label]["rounds_vs_sync"] = [row["vs_sync"] for row in rows]
        if "paired_vs_sync" in rows[0]:
            merged[label]["rounds_paired"] = [row["paired_vs_sync"] for row in rows]
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megathunder bench schedules", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs/quickstart.yaml"),
                   help="the base config every run starts from (default: the quickstart's)")
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["quickstart", "tools"],
                   help="default: quickstart tools")
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES),
                   help="default: all four")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the figures leave the first out)")
    p.add_argument("--sft-steps", type=int, default=60,
                   help="the first run's SFT warm start; the others start from its model (0: the configured model)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--rounds", type=positive, default=1,
                   help="run everything N times, every other round in reverse order; ratios are medians over rounds")
    p.add_argument("--tool-latency", type=float, default=0.5, help="seconds added to every tool call on the tools workload")
    p.add_argument("--verifier-latency", type=float, default=1.0, help="per reward on the tools workload")
    p.add_argument("--slow-verifier-latency", type=float, default=3.0, help="per reward on the verifier workload")
    p.add_argument("--ablate", nargs="*", choices=sorted(ABLATIONS), default=[],
                   help="one more thunder run per name, with that mechanism off")
    p.add_argument("--paired", action="store_true",
                   help="one more thunder run that takes sync's path at even steps: thunder/sync from one run's steps")
    p.add_argument("--out", default=None, help="keep the runs here (default: a temporary folder)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every run")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        print(f"{'workload':<12}{'schedule':<12}{'step':>9}       {'learner idle':>12} {'steps/h':>9}")
        report = {w: run_workload(w, args, root) for w in args.workloads}
    for w, res in report.items():
        if "sync" in res:
            print(f"{w}: overlap bound B = {res['sync']['bound']:.2f}")
        for label, r in res.items():
            if label.startswith("thunder") and "sync" in res:
                each = (f"; median of {len(r['rounds_vs_sync'])} rounds: "
                        + " ".join(f"{x:.2f}" for x in r["rounds_vs_sync"]) if "rounds_vs_sync" in r else "")
                print(f"{w}: {label}/sync steps per hour = {r['vs_sync']:.2f} ({r['of_bound']:.0%} of B{each})")
        if "paired" in res:
            r = res["paired"]
            print(f"{w}: thunder/sync within one run (paired steps) = {r['paired_vs_sync']:.2f} (sync "
                  f"{r['sync_step_s']:.3f} s, thunder {r['thunder_step_s']:.3f} s a step; median of {r['pairs']:.0f} pairs"
                  + (f"; rounds: {' '.join(f'{x:.2f}' for x in r['rounds_paired'])}" if "rounds_paired" in r else "")
                  + ")")
            if f"sync_{ANSWERS}_ms" in r:  # the run's trace gave its phases (paired_phases)
                print(f"{w}: thunder minus sync per phase (ms, median over pairs): "
                      + ", ".join(f"{text} {r[f'phase_{name}_ms']:+.1f}" for name, text in PHASES.items()))
                print(f"{w}: sync's own phases (ms, median over the same pairs): "
                      + ", ".join(f"{text} {r[f'sync_{name}_ms']:.1f}" for name, text in PHASES.items())
                      + f"; its episodes end within the rollout's last {r[f'sync_{ANSWERS}_ms']:.1f} "
                      "(the first one's end to the last's: all a finished trajectory's gradient can overlap)")
    print(json.dumps(report))
    return 0


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
