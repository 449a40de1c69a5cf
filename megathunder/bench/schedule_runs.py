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

Per schedule: wall time per optimizer step, learner idle share, steps per hour, and thunder's
(and every schedule's) ratio to sync in steps per hour, with sync's zero-staleness overlap bound
B = step / (step - learner busy). ``--ablate NAME ...`` adds one thunder run per name with that
mechanism switched off (``ABLATIONS``), in the same invocation, so each one's gain is measured
against the same sync run. The first schedule's run does the SFT warm
start; the others start from its result. ``--out DIR`` keeps every run directory
(``DIR/WORKLOAD/SCHEDULE``: metrics, trace, journal), e.g. for ``megathunder simulate --calibrate``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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
    "tail": ["schedule.probe_overlap=false"],  # sync keeps it: the probe is ours, not sync's algorithm
}


def _latencies(name: str, args) -> tuple[float, float]:
    """(tool, verifier) seconds added to every call on workload ``name``."""
    if name == "tools":
        return args.tool_latency, args.verifier_latency
    if name == "verifier":
        return 0.0, args.slow_verifier_latency
    return 0.0, 0.0


def _train(config: str, out: Path, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "megathunder.cli", "train", config, f"run.output_dir={out}", *overrides]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return json.loads((out / "summary.json").read_text())


def run_workload(name: str, args, root: Path) -> dict:
    tool_s, verifier_s = _latencies(name, args)
    common = [*WORKLOADS[name], f"run.num_steps={args.steps}", "run.progress=false", "run.wandb=disabled",
              "run.checkpoint_every=0", "objective.tis=token", "eval.every_n_steps=0",
              f"agent.added_tool_latency_s={tool_s}", f"agent.added_verifier_latency_s={verifier_s}",
              f"batch.num_prompts_per_batch={args.prompts}", f"batch.samples_per_prompt={args.samples}",
              *args.overrides]
    results, warm = {}, [f"sft.num_steps={args.sft_steps}"]
    runs: list[tuple[str, str, list[str]]] = [(s, s, []) for s in args.schedules]  # (label, schedule, overrides)
    runs += [(f"thunder-no_{a}", "thunder", ABLATIONS[a]) for a in args.ablate]
    for k, (label, schedule, ablation) in enumerate(runs):
        out = root / name / label
        summary = _train(args.config, out, [*common, *warm, f"schedule.mode={schedule}", *ablation])
        if k == 0:  # the others start from this run's model (none built here: the configured one)
            model = out / ("sft_model" if args.sft_steps else "init_model")
            warm = [f"learner.model.hf_checkpoint={model}"] if model.is_dir() else []
            warm.append("sft.num_steps=0")
        step_s = summary["mean_step_s"]
        results[label] = {
            "step_s": step_s,
            "learner_idle_share": summary["learner_idle_share"],
            "steps_per_hour": 3600.0 / step_s,
            "max_policy_lag": summary["max_policy_lag"],
            "reward_last_steps": summary["reward_last_steps"],
        }
        print(f"  {name:<10} {label:<11} {step_s:7.2f} s/step  idle {summary['learner_idle_share']:5.1%}  "
              f"{3600 / step_s:7.0f} steps/h  lag {summary['max_policy_lag']}", flush=True)
    if "sync" in results:
        sync = results["sync"]
        busy = (1.0 - sync["learner_idle_share"]) * sync["step_s"]
        bound = sync["step_s"] / max(sync["step_s"] - busy, busy)  # (W + T) / max(W, T), W = step - T
        for r in results.values():
            r["vs_sync"] = r["steps_per_hour"] / sync["steps_per_hour"]
            r["of_bound"] = r["vs_sync"] / bound
        sync["bound"] = bound
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megathunder bench schedules", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs/quickstart.yaml"))
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["quickstart", "tools"])
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--sft-steps", type=int, default=60)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--tool-latency", type=float, default=0.5)
    p.add_argument("--verifier-latency", type=float, default=1.0, help="per reward on the tools workload")
    p.add_argument("--slow-verifier-latency", type=float, default=3.0, help="per reward on the verifier workload")
    p.add_argument("--ablate", nargs="*", choices=sorted(ABLATIONS), default=[],
                   help="one more thunder run per name, with that mechanism off")
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
                print(f"{w}: {label}/sync steps per hour = {r['vs_sync']:.2f} ({r['of_bound']:.0%} of B)")
    print(json.dumps(report))
    return 0
