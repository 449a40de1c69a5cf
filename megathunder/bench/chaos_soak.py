"""``megathunder bench chaos``: the chaos soak. The quickstart, shortened, once without faults and
then ``--runs`` times with one random fault each (``chaos.faults``, seeded by ``--seed``; the kinds
drawn in rounds, each kind once per round, so every kind is covered), each run a real
``megathunder train`` (vLLM, the Megatron learner, the local sandbox).

A run that stops (exit 75 after a signal, 130 after a torn journal, 1 with the one-line full-disk
error -- the filler is deleted first, as a user frees space -- or with the engine's one line after a
fault inside a weight update) is resumed by the same command, up to
``--max-resumes`` times. Per run: survived in place (exit 0 at once) / stopped and resumed / lost
(anything else: a traceback, a hang past ``--run-timeout`` -- then the attempt's process group and
every process carrying its tag are SIGKILLed -- a claim broken, or a claim that compares a zero
update and so says nothing); per fault kind, the
largest parameter difference from what its claim says the run must equal
(RELIABILITY.md, "Fault injection"):

- the fault-free run of the same deployment (``kill_server``, ``hang_server``, ``kill_engine``,
  ``hang_engine``: the same episodes token for token): ``update_rel`` = ||(w - w0) - (w_ref - w0)||
  / ||w_ref - w0|| from the same warm start w0, and the largest absolute parameter difference;
- the replay of the run's own journal through ``megathunder replay`` (``sync``) for the others
  (their episodes differ from the fault-free run's by design -- a verifier's reward, a tool call's
  observation -- or they stopped and resumed): the batch update of the episodes as they happened.

``hang_sandbox`` and ``oom_tool`` take an episode's own ``bash`` call, so their runs train the
``terminal`` task (a bash tool); a fault whose episodes made no bash call in its step does not fire
(``not_fired``, reported apart).

Runs take SGD steps, so comparing updates compares the gradients (``tests/integration/
test_trainer.py``: ``UPDATE_RTOL`` = 1e-3 is derived there for fp32 summation order). Leaks after
each run and after the soak: processes left (any process carrying this soak's environment tag, or
of a sandbox uid), this process's open file descriptors, what the run left in ``/dev/shm`` (as root
each run gets a mount namespace whose /dev/shm is a directory of its own, so another job's
segments on the machine are not counted; the machine-wide diff is reported beside it), and
containers labelled by the sandbox (docker / podman, where installed). ``fill_disk`` runs write their run
directory on a 64 MiB tmpfs of their own (root only; the kind is left out otherwise). Server faults
run two vLLM servers per run (ports from ``--base-port``, ten apart per run). ``--parallel`` runs
that many at once (the fault-free references first); each run's comparison (a replay) follows it in
its worker.

Prints a table per fault kind, then one JSON object as the last line (``--json``: only it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megathunder.config import ENGINE_FAULTS, EPISODE_FAULTS, IN_PROCESS_FAULTS, SERVER_FAULTS

ROOT = Path(__file__).resolve().parents[2]
UPDATE_RTOL = 1e-3  # tests/integration/test_trainer.py: fp32 summation order, 60x below a wrong batch
TAG_ENV = "MEGATHUNDER_CHAOS_SOAK"
FAULT_FREE_CLAIM = ENGINE_FAULTS
TOOL_TASK: dict[str, dict[str, Any]] = {
    "task": {"name": "terminal"}, "agent": {"max_turns": 3, "max_new_tokens_per_turn": 128, "max_total_tokens": 1536}}
"""The runs of a tool fault (``hang_sandbox``, ``oom_tool``): a task whose episodes have a bash tool
(the config's whole task section replaced: another task's fields are not the terminal task's) and
room for its prompt (the tool schemas: ~540 tokens; the tiny model's context is 2048)."""
TOOL_EXTRA = ["sft.num_steps=40", "objective.entropy_coef=0.01"]
"""Their warm start on the terminal task's scripted turns, long enough that the model calls bash (a
fault whose episodes make no bash call does not fire); an entropy term, so that their update is not
zero when every group's rewards are equal (the tiny model solves no terminal goal)."""
STOP_KINDS = ("sigusr1", "sigint", "fill_disk", "corrupt_journal")
UPDATE_KINDS = ("kill_engine_update", "hang_engine_update")
"""kill_engine / hang_engine with ``during: weight_update``: the run stops in one line (exit 1), resumable."""
KINDS = (*ENGINE_FAULTS, *UPDATE_KINDS, *EPISODE_FAULTS, *STOP_KINDS)
BASE = ["eval.every_n_steps=0", "run.progress=false", "run.wandb=disabled", "run.checkpoint_every=1",
        "ledger.pack_ready_work=false", "batch.num_prompts_per_batch=4", "batch.samples_per_prompt=4",
        "agent.max_concurrent_episodes=16", "sandbox.num_uids=16", "rollout.temperature=0.8",
        "learner.optimizer.name=sgd", "learner.optimizer.lr=1e-2", "learner.optimizer.use_distributed_optimizer=false",
        "verifier.timeout_s=2", "sandbox.wall_time_s=2", "sandbox.memory_mb=256"]
SERVERS = ["rollout.engine.deployment=server", "rollout.engine.num_servers=2", "rollout.engine.stall_timeout_s=5"]
STALL = ["rollout.engine.stall_timeout_s=5"]  # hang_engine: a stopped engine core is found in 5 s
FILLER = ".chaos_fill"


@dataclass
class Run:
    index: int
    kind: str  # "none": a fault-free reference
    fault: dict
    deployment: str
    out: Path
    overrides: list[str]
    attempts: list[int] = field(default_factory=list)  # exit status of each attempt
    outcome: str = ""  # survived / resumed / lost / reference
    claim: str = ""  # fault_free / journal_replay
    update_rel: float | None = None
    max_abs: float | None = None
    seconds: float = 0.0
    leaked_processes: list[str] = field(default_factory=list)
    leaked_shm: list[str] = field(default_factory=list)  # what the run left in its own /dev/shm
    error: str = ""
    mount: Path | None = None
    config: str | None = None  # another config than --config (the tool faults' task)


def _env(tag: str) -> dict[str, str]:
    return {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
            "WANDB_SILENT": "true", TAG_ENV: tag}


def _random_fault(kind: str, rng: random.Random, steps: int, batch: int) -> dict:
    if kind in UPDATE_KINDS:  # the weight push after the step (before its records and checkpoint)
        return {"kind": kind.removesuffix("_update"), "step": rng.randrange(steps),
                "after_trajectories": rng.randrange(batch - 2), "during": "weight_update"}
    if kind in SERVER_FAULTS:
        return {"kind": kind, "step": rng.randrange(steps), "after_trajectories": rng.randrange(batch - 2),
                "server": rng.randrange(2)}
    if kind in IN_PROCESS_FAULTS:
        return {"kind": kind, "step": rng.randrange(steps), "after_trajectories": rng.randrange(batch - 2)}
    if kind in EPISODE_FAULTS:
        return {"kind": kind, "step": rng.randrange(steps),
                "trajectories": sorted(rng.sample(range(batch), rng.randint(1, 3)))}
    if kind == "corrupt_journal":  # needs a checkpoint before it (run.checkpoint_every=1)
        return {"kind": kind, "step": rng.randrange(1, steps)}
    return {"kind": kind, "step": rng.randrange(steps - 1)}  # a stop after the last step is no stop


def _fault_yaml(fault: dict) -> str:
    return "chaos.faults=[" + json.dumps(fault) + "]"


def _tagged_processes(tag: str, sandbox_uids: bool = True) -> list[str]:
    """"PID command" of the processes carrying ``tag`` (or ``tag-N``) in their environment, or (with
    ``sandbox_uids``) owned by a sandbox uid (>= 200000)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            uid = os.stat(f"/proc/{pid}").st_uid
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        mark = f"{TAG_ENV}={tag}".encode()
        if any(e == mark or e.startswith(mark + b"-") for e in environ.split(b"\0")) or (sandbox_uids and uid >= 200_000):
            found.append(f"{pid} {cmd}")
    return found


def _containers() -> int | None:
    from megathunder.rollout.sandbox.container import LABEL

    for cli in ("podman", "docker"):
        if shutil.which(cli):
            proc = subprocess.run([cli, "ps", "--all", "--quiet", "--filter", f"label={LABEL}"], capture_output=True,
                                  text=True, timeout=60)
            return len(proc.stdout.split()) if proc.returncode == 0 else None
    return None


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _mount_tmpfs(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _private_shm(run: Run, args: argparse.Namespace, cmd: list[str]) -> list[str]:
    """``cmd`` in a mount namespace of its own whose /dev/shm is the run's directory (root only), so
    what the run leaves there is its own, not another job's on the machine."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return cmd
    shm = args.shm_root / f"run{run.index:03d}"
    shm.mkdir(parents=True, exist_ok=True)
    shm.chmod(0o1777)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"',
            str(shm), *cmd]


def _run_bounded(cmd: list[str], tag: str, timeout_s: float) -> subprocess.CompletedProcess:
    """``cmd`` in a process group of its own; past ``timeout_s`` the whole group is SIGKILLed, and
    then every process still carrying the run's tag (a run's supervised child leads a session of its
    own, out of the group's reach), so a run that times out leaves nothing behind."""
    proc = subprocess.Popen(cmd, env=_env(tag), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        for line in _tagged_processes(tag, sandbox_uids=False):
            _kill_group(int(line.split()[0]), group=False)
        try:  # a process out of reach that still holds the pipes must not hang the soak
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        return subprocess.CompletedProcess(cmd, -9, out, f"{err}\ntimed out after {timeout_s:.0f} s")


def _kill_group(pid: int, group: bool = True) -> None:
    try:
        if group:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _train(run: Run, args: argparse.Namespace) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megathunder.cli", "train", str(run.config or args.config), f"run.output_dir={run.out}",
           *run.overrides]
    return _run_bounded(_private_shm(run, args, cmd), f"{args.tag}-{run.index}", args.run_timeout)


def execute(run: Run, args: argparse.Namespace) -> Run:
    """Train, resuming a stopped run with the same command; the outcome and the processes left."""
    start = time.monotonic()
    if run.kind != "none" and start > args.budget_end:
        run.outcome = "skipped"  # --time-budget spent: not started
        return run
    if run.mount is not None and not _mount_tmpfs(run.mount):
        run.outcome, run.error = "lost", f"cannot mount a tmpfs at {run.mount}"
        return run
    for _ in range(1 + args.max_resumes):
        proc = _train(run, args)
        run.attempts.append(proc.returncode)
        if proc.returncode == 0:
            break
        lines = [line for line in proc.stderr.splitlines() if line.startswith("megathunder: ")]
        stopped = proc.returncode in (75, 130) or (proc.returncode == 1 and lines and any(
            words in lines[-1] for words in ("no space left on device", "inside a weight update")))
        if not stopped or "Traceback" in proc.stderr:
            run.error = (lines[-1] if lines else proc.stderr.strip()[-800:]) or f"exit {proc.returncode}"
            break
        (run.out / FILLER).unlink(missing_ok=True)  # the user frees the space
    if run.attempts[-1] == 0 and not run.error:
        run.outcome = "reference" if run.kind == "none" else ("survived" if len(run.attempts) == 1 else "resumed")
        if run.kind != "none" and not _fired(run.out):
            run.outcome = "not_fired"  # a tool fault whose episodes made no bash call in its step
    else:
        run.outcome = "lost"
    run.seconds = time.monotonic() - start
    # Processes of the run that are still exiting get a moment. Sandbox processes carry no tag
    # (their launcher's environment is cleared) and every run's sandboxes share the uid range, so
    # with runs side by side they are not this run's to count: the machine-wide check at the
    # soak's end counts them (a sandbox of the run beside it is not a leak of this one).
    alone = args.parallel == 1
    deadline = time.monotonic() + 30
    while (left := _tagged_processes(f"{args.tag}-{run.index}", sandbox_uids=alone)) and time.monotonic() < deadline:
        time.sleep(1)
    run.leaked_processes = left
    shm = args.shm_root / f"run{run.index:03d}"
    run.leaked_shm = sorted(os.listdir(shm)) if shm.is_dir() else []
    return run


def _fired(out: Path) -> bool:
    """The run's fault fired (it is in the run's ``chaos.jsonl``)."""
    record = out / "chaos.jsonl"
    return record.is_file() and bool(record.read_text().strip())


def _weights(path: Path):
    from megathunder.learner.safetensors_io import load_dir

    return load_dir(path)


def compare(run: Run, reference: Path, args: argparse.Namespace) -> None:
    """The run's final parameters against its claim's: the fault-free run or its journal replay."""
    import torch

    if run.outcome in ("lost", "skipped", "not_fired"):
        return
    if run.kind in FAULT_FREE_CLAIM:
        run.claim, target = "fault_free", reference / "final_model"
    else:
        run.claim, target = "journal_replay", run.out / "replayed"
        cmd = [sys.executable, "-m", "megathunder.cli", "replay", str(run.out), "schedule.mode=sync", "--out",
               str(target)]
        proc = _run_bounded(cmd, f"{args.tag}-{run.index}", args.run_timeout)
        if proc.returncode != 0:
            run.outcome, run.error = "lost", f"replay failed: {proc.stderr.strip()[-400:]}"
            return
    w0, w, wt = _weights(run.out / "sft_model"), _weights(run.out / "final_model"), _weights(target)
    diff = torch.cat([(w[k] - wt[k]).double().flatten() for k in w0])
    update = torch.cat([(wt[k] - w0[k]).double().flatten() for k in w0])
    if float(update.norm()) == 0.0:  # equal, and saying nothing: lost, so that no soak passes on it
        run.outcome, run.error = "lost", f"vacuous: its {run.claim}'s update is zero (nothing to compare)"
        return
    run.update_rel = float(diff.norm() / update.norm())
    run.max_abs = float(diff.abs().max())
    if run.update_rel > UPDATE_RTOL:
        run.outcome, run.error = "lost", f"final parameters {run.update_rel:.2e} (update-relative) from its {run.claim}"


def _tool_config(config: Path, root: Path) -> Path:
    """``config`` with its task section replaced by the terminal task's, written under ``root``."""
    cfg = yaml.safe_load(config.read_text())
    cfg["task"] = TOOL_TASK["task"]
    cfg["agent"] = {**cfg.get("agent", {}), **TOOL_TASK["agent"]}
    engine = cfg.setdefault("rollout", {}).setdefault("engine", {})
    engine["max_model_len"] = max(engine.get("max_model_len", 0), 2048)
    path = root / f"{config.stem}_terminal.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def plan(args: argparse.Namespace, root: Path) -> tuple[list[Run], list[Run]]:
    rng = random.Random(args.seed)
    kinds = [k for k in args.kinds if k != "fill_disk" or os.geteuid() == 0]
    batch = 16
    common = [f"run.num_steps={args.steps}", f"sft.num_steps={args.sft_steps}", *BASE, *args.overrides]
    runs, drawn = [], list[str]()
    for i in range(args.runs):
        if not drawn:  # rounds: every kind once per round, in a random order (each kind is covered)
            drawn = rng.sample(kinds, len(kinds))
        kind = drawn.pop()
        fault = _random_fault(kind, rng, args.steps, batch)
        deployment = "server" if kind in SERVER_FAULTS else "in_process"
        extra = [*SERVERS, f"rollout.engine.base_port={args.base_port + 10 * (i + 2)}"] if deployment == "server" else []
        if kind in ("hang_engine", "hang_engine_update"):
            extra = STALL
        config = None
        if kind in ("hang_sandbox", "oom_tool"):
            config, extra = str(_tool_config(Path(args.config), root)), TOOL_EXTRA
        out = root / f"run{i:03d}_{kind}"
        mount = None
        if kind == "fill_disk":
            mount, out = out, out / "run"
        runs.append(Run(i + 2, kind, fault, deployment, out, [*common, *extra, _fault_yaml(fault)], mount=mount,
                        config=config))
    refs = [Run(0, "none", {}, "in_process", root / "reference_in_process", common)]
    if any(r.deployment == "server" for r in runs):
        refs.append(Run(1, "none", {}, "server", root / "reference_server",
                        [*common, *SERVERS, f"rollout.engine.base_port={args.base_port + 10}"]))
    return refs, runs


def summarize(refs: list[Run], all_runs: list[Run], leaks: dict) -> dict:
    runs = [r for r in all_runs if r.outcome not in ("skipped", "not_fired")]
    table = {}
    for kind in sorted({r.kind for r in runs}):
        mine = [r for r in runs if r.kind == kind]
        rels = [r.update_rel for r in mine if r.update_rel is not None]
        abss = [r.max_abs for r in mine if r.max_abs is not None]
        table[kind] = {
            "runs": len(mine),
            "survived": sum(r.outcome == "survived" for r in mine),
            "resumed": sum(r.outcome == "resumed" for r in mine),
            "lost": sum(r.outcome == "lost" for r in mine),
            "claim": mine[0].claim or ("fault_free" if kind in FAULT_FREE_CLAIM else "journal_replay"),
            "max_update_rel": max(rels, default=None),
            "max_abs_diff": max(abss, default=None),
            "leaked_processes": sum(len(r.leaked_processes) for r in mine),
            "leaked_shm": sum(len(r.leaked_shm) for r in mine),
            "mean_s": sum(r.seconds for r in mine) / len(mine),
        }
    return {"table": table, "runs": len(runs), "skipped": sum(r.outcome == "skipped" for r in all_runs),
            "not_fired": sum(r.outcome == "not_fired" for r in all_runs), "lost": sum(r.outcome == "lost" for r in runs),
            "references_ok": all(r.outcome == "reference" for r in refs), "tolerance_update_rel": UPDATE_RTOL,
            **leaks, "details": [{**{k: v for k, v in asdict(r).items() if k not in ("overrides", "mount")},
                                  "out": str(r.out)} for r in (*refs, *all_runs)]}


def print_table(result: dict) -> None:
    head = f"{'fault':<16}{'runs':>5}{'survived':>9}{'resumed':>8}{'lost':>5}  {'claim':<15}{'max update diff':>16}" \
           f"{'max |dw|':>10}{'procs left':>11}{'shm left':>9}{'mean s':>8}"
    print(head)
    print("-" * len(head))
    for kind, row in result["table"].items():
        rel = "-" if row["max_update_rel"] is None else f"{row['max_update_rel']:.2e}"
        mx = "-" if row["max_abs_diff"] is None else f"{row['max_abs_diff']:.1e}"
        print(f"{kind:<16}{row['runs']:>5}{row['survived']:>9}{row['resumed']:>8}{row['lost']:>5}  {row['claim']:<15}"
              f"{rel:>16}{mx:>10}{row['leaked_processes']:>11}{row['leaked_shm']:>9}{row['mean_s']:>8.1f}")
    print(f"runs {result['runs']} (not started, past --time-budget: {result['skipped']}), lost {result['lost']}; tolerance {result['tolerance_update_rel']:g} (update-relative); "
          f"leaks after the soak: processes {len(result['processes_left'])}, fds {result['fds_before']} -> "
          f"{result['fds_after']}, /dev/shm entries left by the runs {result['shm_left']} (machine-wide new: "
          f"{len(result['shm_new'])}, any job's), containers "
          f"{result['containers_after']}")
    for d in result["details"]:
        if d["outcome"] == "lost" or (d["kind"] == "none" and d["outcome"] != "reference"):
            print(f"  lost: run {d['index']} {d['kind']} {d['fault']}: {d['error']} (exits {d['attempts']})")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megathunder bench chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="chaos runs (one random fault each; kinds in rounds, each once per round)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per run (>= 2)")
    p.add_argument("--sft-steps", type=int, default=4)
    p.add_argument("--config", default=str(ROOT / "configs/quickstart.yaml"))
    p.add_argument("--parallel", type=int, default=1, help="runs at once")
    p.add_argument("--max-resumes", type=int, default=3)
    p.add_argument("--run-timeout", type=int, default=900, help="seconds per attempt")
    p.add_argument("--base-port", type=int, default=18700, help="server faults: ports from here")
    p.add_argument("--time-budget", type=float, default=float("inf"),
                   help="seconds after which no further chaos run starts (those left are reported as skipped)")
    p.add_argument("--out", default=None, help="keep run directories here (default: a temporary one, removed)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="more overrides for every run")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the stop faults need a step after theirs)")
    args.tag = f"{os.getpid()}-{int(time.time())}"
    args.budget_end = time.monotonic() + args.time_budget
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="chaos-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    args.shm_root = root / "shm"
    fds_before, shm_before = len(os.listdir("/proc/self/fd")), _shm()
    refs, runs = plan(args, root)
    try:
        ready = {r.deployment: threading.Event() for r in refs}

        def one(run: Run) -> Run:  # a run, then at once its comparison (a replay runs beside other runs)
            execute(run, args)
            if run.kind == "none":
                ready[run.deployment].set()
            elif run.outcome != "skipped":
                ref = next(r for r in refs if r.deployment == run.deployment)
                if run.kind in FAULT_FREE_CLAIM:
                    ready[run.deployment].wait()
                if run.kind in FAULT_FREE_CLAIM and ref.outcome != "reference":
                    run.outcome, run.error = "lost", "no fault-free reference (it failed)"
                else:
                    compare(run, ref.out, args)
            return run

        with ThreadPoolExecutor(max(1, args.parallel)) as pool:
            for done in pool.map(one, [*refs, *runs]):
                with open(root / "runs.jsonl", "a") as f:  # as they finish: a partial soak still has its record
                    f.write(json.dumps({"index": done.index, "kind": done.kind, "fault": done.fault,
                                        "outcome": done.outcome, "attempts": done.attempts, "error": done.error}) + "\n")
                if not args.json:
                    print(f"run {done.index:3d} {done.kind:<16} {done.outcome:<9} exits {done.attempts} "
                          f"{done.seconds:5.1f} s {done.error}", flush=True)
    finally:
        for run in runs:
            if run.mount is not None:
                subprocess.run(["umount", "-l", str(run.mount)], check=False, capture_output=True)
    time.sleep(2)
    leaks = {"processes_left": _tagged_processes(args.tag), "fds_before": fds_before,
             "fds_after": len(os.listdir("/proc/self/fd")), "shm_new": sorted(_shm() - shm_before),
             "containers_after": _containers()}
    leaks["shm_left"] = sum(len(r.leaked_shm) for r in (*refs, *runs))
    result = summarize(refs, runs, leaks)
    if not args.out:
        shutil.rmtree(root, ignore_errors=True)
    if not args.json:
        print_table(result)
    print(json.dumps(result))
    return 0 if result["lost"] == 0 and result["references_ok"] else 1
