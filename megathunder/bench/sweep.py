"""Submit a grid of training runs to Slurm, follow them, and tabulate their throughput.

    megathunder sweep GRID.yaml --out DIR            # submit, wait, write the table and plot
    megathunder sweep GRID.yaml --out DIR --dry-run  # print the sbatch lines only
    megathunder sweep GRID.yaml --out DIR --collect  # table and plot from finished runs only

The grid (YAML) names a launch script, its environment and sbatch arguments, a base config, and
axes; every combination of one point per axis is one job (e.g. model size x TP/PP/DP x schedule):

    name: tiny-schedules
    script: launch/slurm/grpo_128gpu.sh
    config: tests/cluster/grpo_cpu.yaml
    sbatch: [--nodes=1, --ntasks-per-node=2]
    env: {MT_GPUS_PER_NODE: 0, MT_ROLLOUT_NODES: 0, MT_LEARNER_TASKS_PER_NODE: 2}
    overrides: [run.num_steps=3]
    one_at_a_time: true         # sbatch --dependency=singleton: runs do not share the machine
    peak_tflops_per_gpu: null   # e.g. 989 (H100 bf16 dense); null: MFU is n/a
    axes:
      model:  [{name: tiny}]
      layout: [{name: dp2, gpus: 2}]      # gpus: learner GPUs, the MFU denominator
      schedule: [{name: sync, overrides: [schedule.mode=sync]}, {name: thunder, overrides: [schedule.mode=thunder]}]

A point may carry ``overrides`` (config key=value), ``env`` and ``sbatch`` (appended), and
``gpus``. Each run writes to DIR/runs/NAME (run.output_dir) with logs in DIR/logs/NAME.

Jobs go through ``sbatch`` / ``squeue`` / ``scontrol``. pyslurm is not used: the index only has
pyslurm 25.11, which refuses other Slurm versions (the local test cluster is 22.05), so a pyslurm
path could not be tested; ``--backend`` reports what it finds.

Per run, from its metrics.jsonl, journal.jsonl and final_model/: steps, mean step time, trained
tokens/s (every token of every trajectory the learner trained on, over the summed step time),
generated tokens/s, and MFU = the model FLOPs of the trained trajectories (6 N + 12 L h s a token,
``megathunder.plan.flops``: the formula ``bench learner`` and the trainer use) / (summed step time x
GPUs x peak FLOP/s) where the peak is given (n/a on CPU), and HFU counting recomputation too. Writes DIR/sweep.csv, DIR/sweep.md and DIR/sweep.png.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import re
import shlex
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megathunder.config import load_config
from megathunder.plan.flops import Utilisation
from megathunder.plan.memory_plan import ModelShape, read_model_config

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}
COLUMNS = ("run", "job_id", "state", "steps", "mean_step_s", "trained_tokens_per_s", "generated_tokens_per_s",
           "params", "gpus", "mfu", "hfu")


@dataclass
class Run:
    name: str
    axes: dict[str, str]
    overrides: list[str]
    env: dict[str, str]
    sbatch: list[str]
    gpus: int | None
    job_id: int | None = None
    state: str = "NOT_SUBMITTED"
    exit_code: str = ""
    result: dict = field(default_factory=dict)


def expand_grid(grid: dict) -> list[Run]:
    axes = grid.get("axes") or {}
    if not axes:
        raise SystemExit("sweep: the grid has no axes")
    runs = []
    for combo in itertools.product(*(axes[a] for a in axes)):
        points = dict(zip(axes, combo, strict=True))
        for axis, point in points.items():
            if "name" not in point:
                raise SystemExit(f"sweep: a point of axis {axis!r} has no name: {point}")
        gpus = [p["gpus"] for p in points.values() if "gpus" in p]
        runs.append(Run(
            name="-".join(str(p["name"]) for p in points.values()),
            axes={a: str(p["name"]) for a, p in points.items()},
            overrides=[*grid.get("overrides", []), *(o for p in points.values() for o in p.get("overrides", []))],
            env={**{k: str(v) for k, v in (grid.get("env") or {}).items()},
                 **{k: str(v) for p in points.values() for k, v in (p.get("env") or {}).items()}},
            sbatch=[*grid.get("sbatch", []), *(a for p in points.values() for a in p.get("sbatch", []))],
            gpus=gpus[-1] if gpus else None,
        ))
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise SystemExit(f"sweep: point names do not make unique run names: {names}")
    return runs


# ---- Slurm through its commands --------------------------------------------------------------
def slurm_version() -> str:
    out = subprocess.run(["sinfo", "--version"], capture_output=True, text=True, check=False).stdout
    return out.split()[-1] if out.strip() else "unknown"


def describe_backend() -> str:
    try:
        import pyslurm  # noqa: F401
    except ImportError:
        return "sbatch/squeue/scontrol (pyslurm not installed)"
    version = getattr(sys.modules["pyslurm"], "__version__", "?")
    return f"sbatch/squeue/scontrol (pyslurm {version} installed, Slurm {slurm_version()}; pyslurm path not used)"


def sbatch_command(grid: dict, run: Run, out: Path) -> list[str]:
    args = ["sbatch", "--parsable", f"--job-name={grid.get('name', 'sweep')}",
            f"--output={out / 'logs' / (run.name + '.out')}"]
    if grid.get("one_at_a_time"):
        args.append("--dependency=singleton")
    return [*args, *run.sbatch, grid["script"]]


def run_env(grid: dict, run: Run, out: Path) -> dict[str, str]:
    overrides = [*run.overrides, f"run.output_dir={(out / 'runs' / run.name).resolve()}"]
    return dict(os.environ, **run.env, MT_CONFIG=str(grid["config"]), MT_OVERRIDES=" ".join(overrides),
                MT_LOG_DIR=str((out / "logs" / run.name).resolve()))


def submit(grid: dict, runs: list[Run], out: Path, dry_run: bool) -> None:
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for run in runs:
        cmd, env = sbatch_command(grid, run, out), run_env(grid, run, out)
        if dry_run:
            print(f"MT_CONFIG={env['MT_CONFIG']} MT_OVERRIDES={shlex.quote(env['MT_OVERRIDES'])} "
                  f"{' '.join(f'{k}={v}' for k, v in run.env.items())} {shlex.join(cmd)}")
            continue
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"sweep: sbatch failed for {run.name}: {proc.stderr.strip()}")
        run.job_id, run.state = int(proc.stdout.strip().split(";")[0]), "PENDING"
        print(f"sweep: {run.name}: job {run.job_id}", flush=True)


def poll(runs: list[Run]) -> None:
    """States from squeue (live jobs), then scontrol for the ones squeue no longer lists."""
    live = [r for r in runs if r.job_id is not None and r.state not in TERMINAL]
    if not live:
        return
    ids = ",".join(str(r.job_id) for r in live)
    out = subprocess.run(["squeue", "-h", "-j", ids, "-o", "%i %T"], capture_output=True, text=True,
                         check=False).stdout
    listed = dict(line.split() for line in out.splitlines() if line.strip())
    for run in live:
        info = subprocess.run(["scontrol", "show", "job", "-o", str(run.job_id)], capture_output=True, text=True,
                              check=False).stdout
        state = re.search(r"JobState=(\S+)", info)
        run.state = state.group(1) if state else listed.get(str(run.job_id), "UNKNOWN")
        code = re.search(r"\bExitCode=(\S+)", info)
        run.exit_code = code.group(1) if code else ""


def track(runs: list[Run], timeout_s: float, poll_s: float) -> None:
    t0, last = time.monotonic(), None
    while True:
        poll(runs)
        now = ", ".join(f"{r.name} {r.state}" for r in runs)
        if now != last:
            print(f"sweep [{time.monotonic() - t0:5.0f} s]: {now}", flush=True)
            last = now
        if all(r.state in TERMINAL or r.state == "UNKNOWN" for r in runs):
            return
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"sweep: runs not finished after {timeout_s:.0f} s: {now}")
        time.sleep(poll_s)


# ---- what each run measured ------------------------------------------------------------------
def count_parameters(model_dir: Path) -> int | None:
    """Parameters in a HF safetensors directory, from the files' headers (no tensors read)."""
    total, found = 0, False
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for dim in entry["shape"]:
                    n *= dim
                total, found = total + n, True
    return total if found else None


def measure(run_dir: Path, gpus: int | None, peak_tflops: float | None) -> dict:
    rows = []
    if (run_dir / "metrics.jsonl").is_file():
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        return {}
    lengths = []  # each trained trajectory's sequence (its tokens but the last: the positions forwarded)
    if (run_dir / "journal.jsonl").is_file():
        for line in (run_dir / "journal.jsonl").read_text().splitlines():
            entry = json.loads(line)
            entry = entry.get("rec", entry)  # journal records are {"crc": ..., "rec": {...}}
            if entry.get("type") == "trajectory":
                lengths.append(len(entry["tokens"]) - 1)
    trained = sum(n + 1 for n in lengths)
    step_s = sum(r["step_s"] for r in rows)
    params = count_parameters(run_dir / "final_model") if (run_dir / "final_model").is_dir() else None
    trained_tps = trained / step_s if step_s > 0 else 0.0
    mfu = hfu = None
    shape = _shape(run_dir)
    if shape is not None and gpus and peak_tflops and step_s > 0:
        cfg = load_config(run_dir / "config.yaml")
        columns = Utilisation(shape, cfg.learner.activations.recompute, gpus, peak_tflops).columns(lengths, step_s)
        mfu, hfu = columns["mfu"], columns["hfu"]
    return {"steps": len(rows), "mean_step_s": step_s / len(rows), "trained_tokens_per_s": trained_tps,
            "generated_tokens_per_s": sum(r["generated_tokens"] for r in rows) / step_s if step_s > 0 else 0.0,
            "params": params, "gpus": gpus, "mfu": mfu, "hfu": hfu}


def _shape(run_dir: Path) -> ModelShape | None:
    """The run's model shape, from its final model's config.json (None before it exists)."""
    model = run_dir / "final_model"
    if not (model / "config.json").is_file() or not (run_dir / "config.yaml").is_file():
        return None
    cfg = load_config(run_dir / "config.yaml")
    return ModelShape.of(read_model_config(model, cfg.learner.model, "final_model"))


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_table(grid: dict, runs: list[Run], out: Path) -> list[dict]:
    axes = list(grid["axes"])
    table = []
    for run in runs:
        run.result = measure(out / "runs" / run.name, run.gpus, grid.get("peak_tflops_per_gpu"))
        table.append({"run": run.name, **run.axes, "job_id": run.job_id, "state": run.state,
                      **{c: run.result.get(c) for c in COLUMNS[3:]}})
    header = ["run", *axes, *COLUMNS[1:]]
    with open(out / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows({k: ("" if row[k] is None else row[k]) for k in header} for row in table)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(row[k]) for k in header) + " |" for row in table]
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    plot(table, out / "sweep.png")
    return table


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["run"] for row in table]
    fig, axs = plt.subplots(1, 2, figsize=(4 + 1.2 * len(names), 3.6))
    for ax, key, label in ((axs[0], "trained_tokens_per_s", "trained tokens/s"),
                           (axs[1], "mean_step_s", "mean step time (s)")):
        ax.bar(names, [row[key] or 0 for row in table], color="tab:blue")
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=30)
    mfus = [row["mfu"] for row in table]
    fig.suptitle("sweep: " + ("MFU " + ", ".join(_fmt(m) for m in mfus) if any(mfus) else "MFU n/a (no peak FLOP/s)"))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("grid", help="grid YAML")
    p.add_argument("--out", required=True, help="sweep directory (runs/, logs/, sweep.csv/.md/.png, jobs.json)")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch command lines only")
    p.add_argument("--collect", action="store_true", help="no submission: tabulate the runs in --out")
    p.add_argument("--timeout-s", type=float, default=3600)
    p.add_argument("--poll-s", type=float, default=2.0)


def run(args: argparse.Namespace) -> int:
    grid = yaml.safe_load(Path(args.grid).read_text())
    for key in ("script", "config"):
        if key not in grid:
            raise SystemExit(f"sweep: the grid needs {key!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = expand_grid(grid)
    jobs = out / "jobs.json"
    if args.collect:
        known = json.loads(jobs.read_text()) if jobs.is_file() else {}
        for run in runs:
            run.job_id, run.state = known.get(run.name, {}).get("job_id"), known.get(run.name, {}).get("state", "?")
    else:
        print(f"sweep: {len(runs)} runs through {describe_backend()}", flush=True)
        submit(grid, runs, out, args.dry_run)
        if args.dry_run:
            return 0
        track(runs, args.timeout_s, args.poll_s)
        jobs.write_text(json.dumps({r.name: {"job_id": r.job_id, "state": r.state, "exit_code": r.exit_code}
                                    for r in runs}, indent=2) + "\n")
    write_table(grid, runs, out)
    print((out / "sweep.md").read_text(), end="")
    print(f"sweep: {out / 'sweep.csv'}, {out / 'sweep.md'}, {out / 'sweep.png'}")
    failed = [r.name for r in runs if r.state != "COMPLETED"]
    if failed:
        print(f"sweep: not completed: {', '.join(failed)} (logs in {out / 'logs'})", file=sys.stderr)
    return 1 if failed else 0

