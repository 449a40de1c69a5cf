"""The trainer end to end on the real parts: vLLM (CPU) rollouts, the Megatron learner (gloo).

One short quickstart run (SFT warm start + GRPO thunder) is the base; the other schedules start
from its warm-started model; every run samples at temperature 0.8. Checked: the run's outputs (metrics, journal, timeline, wandb files,
checkpoint, final weights), zero staleness every step (probe) in sync/thunder, lag 1 in async,
bounded lag in fully_async, replay of the journal through sync and thunder (1 process, TP = 2,
DP = 2) giving the live run's parameters, and kill + resume reproducing the uninterrupted
parameters (by replay).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1",
       "VLLM_LOGGING_LEVEL": "WARNING", "WANDB_SILENT": "true"}
SGD = ["learner.optimizer.name=sgd", "learner.optimizer.lr=1e-2", "learner.optimizer.use_distributed_optimizer=false"]
"""Runs whose parameters are compared take SGD steps: the update is then linear in the gradient, so
comparing updates compares the gradients the claims are about. (Adam's first steps are about
lr * sign(g): a coordinate whose gradient is near zero flips between two fp32 summation orders and
moves by 2 lr, so Adam's parameters differ by more than any gradient does.)"""
SMALL = [
    "batch.num_prompts_per_batch=4", "batch.samples_per_prompt=4", "agent.max_concurrent_episodes=16",
    "sandbox.num_uids=16", "run.progress=false", *SGD,
    # sampled at T != 1: the learner must train softmax(z / T) (the probe, at T, stops the run if not)
    "rollout.temperature=0.8",
    "eval.every_n_steps=1",  # pass@k on the held-out problems after every step (the report's curve)
]
UPDATE_RTOL = 1e-3
"""How far two runs' parameter updates from the same start (``update_error``, relative) may differ
when they differ only in fp32 summation order. Per coordinate a sum of n terms in another order
differs by at most about n * 2^-24 * sum_i |term_i|; a GRPO gradient sum_i A_i h_i cancels heavily
(each group's advantages sum to zero, and its trajectories' h_i are alike), so relative to the
update the difference is that bound times the cancellation factor sum_i |A_i h_i| / |sum_i A_i h_i|,
which the data sets. Measured on these runs: 1.2e-5 (live thunder vs its sync replay, 3 steps;
replaying thunder in the journal's order gives 0.0). 1e-3 is 80x that, and 60x below what a wrong
batch changes (one of 16 trajectories dropped or counted twice moves the update by ~6e-2)."""


def train(out: Path, *overrides: str, timeout: int = 600, knobs: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``megathunder train`` of the quickstart (``knobs``: the benchmarks' ``bench_train`` instead,
    with those options)."""
    entry = ["megathunder.bench.bench_train", *knobs] if knobs else ["megathunder.cli", "train"]
    cmd = [sys.executable, "-m", *entry, str(ROOT / "configs/quickstart.yaml"), f"run.output_dir={out}", *SMALL,
           *overrides]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "nanobind: leaked" not in proc.stderr, proc.stderr[-3000:]  # the frozen heap is thawed before exit
    return proc


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(path: Path) -> dict[str, torch.Tensor]:
    from megathunder.learner.safetensors_io import load_dir

    return load_dir(path)


def update_error(start: Path, a: Path, b: Path) -> float:
    """|| (a - start) - (b - start) || / || b - start ||: how much two runs' updates of the same
    initial weights differ, relative to the update."""
    w0, wa, wb = weights(start), weights(a), weights(b)
    assert w0.keys() == wa.keys() == wb.keys()
    diff = torch.cat([(wa[k] - wb[k]).double().flatten() for k in w0])
    update = torch.cat([(wb[k] - w0[k]).double().flatten() for k in w0])
    assert float(update.norm()) > 0, "the steps did not move the weights"
    return float(diff.norm() / update.norm())


def replay(run: Path, out: Path, mode: str, nproc: int = 1, *extra: str) -> dict:
    args = ["-m", "megathunder.cli", "replay", str(run), f"schedule.mode={mode}", *extra, "--out", str(out)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    else:
        cmd = [sys.executable, *args]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The quickstart, shortened: SFT warm start, then 3 GRPO steps on the thunder schedule
    (without ready-work packing: which events the learner held depends on its timing, which the
    journal does not record, and the replay below is compared bitwise)."""
    out = tmp_path_factory.mktemp("quickstart")
    train(out, "run.num_steps=3", "sft.num_steps=8", "sft.batch_size=16", "run.wandb=offline",
          "run.checkpoint_every=0", "ledger.pack_ready_work=false")
    return out


def warm(base: Path) -> list[str]:
    return [f"learner.model.hf_checkpoint={base / 'sft_model'}", "sft.num_steps=0", "run.wandb=disabled"]


def test_quickstart_writes_its_report_and_checks_every_step(base):
    r = rows(base)
    assert [x["step"] for x in r] == [0, 1, 2]
    assert all(x["policy_lag_max"] == 0 for x in r)
    assert all(0 <= x["probe_gap"] <= 1e-3 for x in r)  # vLLM samples from the learner's weights
    assert all(x["num_episodes"] == 16 and x["kept_groups"] + x["dropped_groups"] == 4 for x in r)
    summary = json.loads((base / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["schedule"] == "thunder"
    assert not any(key.startswith("sim_") for key in summary)  # the simulator is a command of its own
    assert (base / "timeline.png").stat().st_size > 10_000
    trace = json.loads((base / "trace.json").read_text())["traceEvents"]
    assert {"finished", "reward", "close", "step", "send_weights"} <= {e["name"] for e in trace}
    assert (base / "checkpoints" / "latest").read_text().strip() == "step_3"
    assert (base / "final_model" / "model.safetensors").is_file()
    assert list((base / "wandb").glob("offline-run-*")), "wandb offline run missing"
    journal = [json.loads(line)["rec"] for line in (base / "journal.jsonl").read_text().splitlines()]
    trajectories = [r for r in journal if r["type"] == "trajectory"]
    assert len(trajectories) == 3 * 16
    assert all("failure" in r and "stop_reason" in r for r in trajectories)  # why each ended, and faults


def test_the_simulator_calibrates_on_the_quickstart_run(base):
    """The trace holds what calibration needs; the bound is loose on purpose: two measured steps
    of a one-turn task on a shared CPU, where a stall of another job moves a step by tens of %.
    The 15% check is BENCHMARKS.md's, on 6-step runs of each schedule."""
    from megathunder.simulate.calibrate import calibrate
    from megathunder.simulate.run_dir import load_run

    from megathunder.simulate.calibrate import schedule_estimates

    result = calibrate(load_run(base))
    assert result["schedule"] == "thunder" and result["steps"] == 3
    assert result["fitted"]["learner_seconds_per_token"] > 0 and result["fitted"]["weight_sync_s"] > 0
    assert abs(result["error"]) < 0.5, result
    # what thunder bought on this run's own workload: its events replayed under sync and thunder
    est = schedule_estimates(base)
    assert est["sim_sync_step_s"] > 0 and est["sim_thunder_step_s"] > 0
    assert est["sim_thunder_speedup"] == pytest.approx(est["sim_sync_step_s"] / est["sim_thunder_step_s"], rel=1e-2)


def test_replay_through_sync_and_thunder_gives_the_live_parameters(base, tmp_path):
    start, live = base / "sft_model", base / "final_model"
    thunder = replay(base, tmp_path / "thunder", "thunder")
    sync = replay(base, tmp_path / "sync", "sync")
    assert thunder["replayed_steps"] == sync["replayed_steps"] == 3
    # thunder replayed in the journal's event order sums in the live run's order: the same bits
    replayed, trained = weights(tmp_path / "thunder"), weights(live)
    assert replayed.keys() == trained.keys() and all(torch.equal(replayed[k], trained[k]) for k in trained)
    errors = [update_error(start, tmp_path / "sync", live), update_error(start, tmp_path / "sync", tmp_path / "thunder")]
    print("relative update differences (sync replay vs live; vs thunder replay):", errors)
    assert max(errors) <= UPDATE_RTOL


@pytest.mark.parametrize("layout", [
    # TP=2's streamed and sync gradients equal one process's in tests/distributed/test_learner.py
    pytest.param("learner.parallel.tensor_parallel=2", marks=pytest.mark.slow), "learner.parallel.data_parallel=2"])
def test_replay_on_two_ranks_gives_the_same_parameters(base, tmp_path, layout):
    replay(base, tmp_path / "thunder2", "thunder", 2, layout)
    replay(base, tmp_path / "sync2", "sync", 2, layout)
    start, live = base / "sft_model", base / "final_model"
    assert update_error(start, tmp_path / "thunder2", live) <= UPDATE_RTOL
    assert update_error(start, tmp_path / "sync2", live) <= UPDATE_RTOL


@pytest.fixture(scope="module")
def sync_run(base, tmp_path_factory) -> Path:
    """Weights pushed by the collective path (gloo broadcast, 1 MiB buckets): the probe checks them.
    Requests scheduled by trajectory start (vLLM's priority scheduling)."""
    out = tmp_path_factory.mktemp("sync")
    train(out, "schedule.mode=sync", "run.num_steps=2", "rollout.engine.weight_transfer.kind=collective",
          "rollout.engine.weight_transfer.bucket_mb=1", "rollout.engine.scheduling=trajectory_start", *warm(base))
    return out


def test_sync_schedule_is_zero_stale(sync_run):
    r = rows(sync_run)
    assert [x["policy_lag_max"] for x in r] == [0, 0]
    assert all(x["probe_gap"] <= 1e-3 for x in r)


def test_eval_report_compares_two_schedules(base, sync_run, tmp_path):
    """Periodic held-out evaluation lands in metrics.jsonl; the comparison report turns the sync
    and thunder runs into a score-vs-GPU-hours picture and a time-to-score table."""
    from megathunder.eval.cost_report import build_report

    for run in (base, sync_run):
        evals = [x for x in rows(run) if "eval/pass@1" in x]
        assert len(evals) == len(rows(run)) and all(x["eval/num_instances"] == 9 for x in evals)
    build_report([str(sync_run), str(base)], tmp_path)
    assert (tmp_path / "score_vs_gpu_hours.png").stat().st_size > 10_000
    assert "thunder" in (tmp_path / "time_to_score.md").read_text()


# DAPO's refill streamed exactly: tests/unit/test_streaming_exact.py (add_group) and tests/unit/test_refill.py
@pytest.mark.slow
def test_dapo_refill_under_thunder_trains_full_batches_and_replays_exactly(base, tmp_path):
    """DAPO's dynamic sampling with refill (``batch.max_refill_groups``) under thunder: every dropped
    group is replaced while the batch streams (``add_group``), so each step trains 4 kept groups; the
    journal replayed through thunder gives the live parameters bit for bit, through sync the same
    update within UPDATE_RTOL. (The warm-started model solves most prompts: most groups drop.)"""
    budget = 16  # 4 + 16 prompts of the task's 23 training ones
    run = tmp_path / "run"
    train(run, "objective.dapo_dynamic_sampling=true", f"batch.max_refill_groups={budget}",
          "rollout.engine.scheduling=group_aware", "run.num_steps=3", "eval.every_n_steps=0",
          "ledger.pack_ready_work=false", *warm(base))  # held work depends on timing: bitwise replay without it
    r = rows(run)
    print([(x["kept_groups"], x["dropped_groups"]) for x in r])
    for x in r:
        assert x["kept_groups"] == 4 or x["kept_groups"] + x["dropped_groups"] == 4 + budget, x  # or out of budget
        assert x["num_episodes"] == 4 * (x["kept_groups"] + x["dropped_groups"])
    assert sum(x["dropped_groups"] for x in r) > 0, "no group was dropped: the refill was not exercised"
    assert all(x["policy_lag_max"] == 0 and x["probe_gap"] <= 1e-3 for x in r)
    start, live = base / "sft_model", run / "final_model"
    replay(run, tmp_path / "thunder", "thunder")
    replay(run, tmp_path / "sync", "sync")
    replayed, trained = weights(tmp_path / "thunder"), weights(live)
    assert all(torch.equal(replayed[k], trained[k]) for k in trained)
    assert update_error(start, tmp_path / "sync", live) <= UPDATE_RTOL


def test_per_turn_score_gradients_stream_every_trajectory_and_replay_through_sync(base, tmp_path):
    """``ledger.per_turn_scores`` on the multi-turn calculator task with token TIS: every turn event
    reaches the learner with its engine logprobs, every trajectory's h_i is computed turn by turn
    (none falls back to the finish-time path), and the journal replayed through sync gives the same
    update within UPDATE_RTOL (the exact claim is tests/unit/test_score_turns.py)."""
    run = tmp_path / "run"
    train(run, "task.name=calculator", "agent.max_turns=3", "agent.max_new_tokens_per_turn=24",
          "agent.max_total_tokens=800", "rollout.engine.max_model_len=1024",
          "objective.tis=token", "ledger.max_pending=null", "ledger.per_turn_scores=forward_early",
          "learner.precision.core_attention=past_kv", "run.num_steps=2", "eval.every_n_steps=0", *warm(base))
    r = rows(run)
    assert all(x["turn_scores"] == x["num_episodes"] == 16 and x["pending_backward"] == 0 for x in r), r
    assert all(x["policy_lag_max"] == 0 and x["probe_gap"] <= 1e-3 for x in r)
    # step 0's probe was scored while step 1's turns streamed (probe.overlap); the last runs whole
    assert [x["probe_trailed"] for x in r] == [1, 0]
    replay(run, tmp_path / "sync", "sync")
    assert update_error(base / "sft_model", tmp_path / "sync", run / "final_model") <= UPDATE_RTOL


@pytest.mark.slow  # a benchmark knob (bench_train --paired); sync's training is checked by the replay tests
def test_a_paired_run_alternates_sync_and_thunder_steps_and_trains_as_sync(base, tmp_path):
    """``bench_train --paired``: even steps take sync's path, odd ones thunder's, each named in its
    metrics row, every one zero-stale; the run's update is sync's (its journal replayed through
    sync) within UPDATE_RTOL. ``megathunder bench schedules --paired`` reads these rows."""
    from megathunder.bench.schedule_runs import paired

    run = tmp_path / "run"
    train(run, "run.num_steps=3", "eval.every_n_steps=0", *warm(base), knobs=("--paired",))
    r = rows(run)
    assert [x["schedule"] for x in r] == ["sync", "thunder", "sync"]
    assert all(x["policy_lag_max"] == 0 and x["probe_gap"] <= 1e-3 for x in r)
    figures = paired(run / "metrics.jsonl")
    assert figures["pairs"] == 1 and figures["paired_vs_sync"] == r[0]["step_s"] / r[1]["step_s"]
    replay(run, tmp_path / "sync", "sync")
    assert update_error(base / "sft_model", tmp_path / "sync", run / "final_model") <= UPDATE_RTOL


def test_a_stale_push_stops_the_run_at_its_trailing_probe_before_the_next_batch_is_trained(base, tmp_path):
    """``probe.overlap``: vLLM's part of push k's probe runs at once, the learner scores it
    while batch k + 1 generates, and the schedules check it before batch k + 1's gradient is closed.
    ``chaos.faults`` stale_push: the push after step 1 loads nothing while the engine stamps version
    2, so vLLM repeats the previous probe bit for bit while the learner's logprobs moved: the run
    must stop there, where step 2 awaits it (before step 2's close and optimizer step), with step 0's
    records written (its own probe trailed and passed) and step 1's not."""
    cmd = [sys.executable, "-m", "megathunder.cli", "train", str(ROOT / "configs/quickstart.yaml"),
           f"run.output_dir={tmp_path}", *SMALL, *warm(base), "run.num_steps=3", "eval.every_n_steps=0",
           "chaos.faults=[{kind: stale_push, step: 1}]"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-5000:]
    assert "StaleWeightsError" in proc.stderr and "policy version 2" in proc.stderr, proc.stderr[-3000:]
    assert "bit for bit" in proc.stderr and "in thunder_step" in proc.stderr, proc.stderr[-3000:]
    r = rows(tmp_path)
    assert [x["step"] for x in r] == [0] and r[0]["probe_trailed"] == 1 and 0 <= r[0]["probe_gap"] <= 1e-3, r
    journal = [json.loads(line)["rec"] for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    assert {x["step"] for x in journal} == {0}


def test_async_schedule_is_one_step_stale(base, tmp_path):
    # PPO's 2 epochs x 2 mini-batches per batch (4 optimizer steps), then the push and the probe
    train(tmp_path, "schedule.mode=async", "objective.tis=token", "run.num_steps=3", "run.timeline_steps=1",
          "objective.num_ppo_epochs=2", "objective.num_minibatches_per_batch=2", *warm(base))
    r = rows(tmp_path)
    assert [x["policy_lag_max"] for x in r] == [0, 1, 1]
    assert all(x["probe_gap"] <= 1e-3 for x in r[1:])
    # the timeline keeps the last run.timeline_steps steps only (bounded memory on long runs)
    trace = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["step"] for e in trace if e["name"] == "generate+tools"} == {2}
    assert min(e["args"]["step"] for e in trace if e["pid"] == 0 and e["tid"] == 0) == 2


def test_fully_async_schedule_bounds_staleness(base, tmp_path):
    # the PPO ratio taken against the engine's logprobs (the behaviour policy): clipped, not TIS-weighted
    train(tmp_path, "schedule.mode=fully_async", "schedule.max_staleness=1", "objective.ppo_old_logprobs=rollout",
          "run.num_steps=3", *warm(base))
    r = rows(tmp_path)
    assert len(r) == 3 and all(x["policy_lag_max"] <= 1 for x in r)
    assert all(x["probe_gap"] <= 1e-3 for x in r)


SLOW_STEPS = ("--verifier-latency=2",)
"""For tests that act between two steps of a 4-step run, which the run must not finish first: run
through ``bench_train`` with 2 s before every reward, each step then takes >= 2 s (a quickstart step
is ~0.3 s), so the test's 0.2 s polls have seconds to spare."""


# a crash and resume equal to the journal replay: tests/integration/test_chaos.py (corrupt_journal, full disk)
@pytest.mark.slow
def test_kill_and_resume_reproduces_the_uninterrupted_parameters(base, tmp_path):
    """SIGKILL the whole run after its step-2 checkpoint, run the same command again: it resumes,
    the journal holds each step once, and the final weights equal a replay of the journal from
    the start (what the uninterrupted run would have computed from the same trajectories)."""
    out = tmp_path / "run"
    args = ["run.num_steps=4", "run.checkpoint_every=2", "eval.every_n_steps=0", *warm(base)]
    cmd = [sys.executable, "-m", "megathunder.bench.bench_train", *SLOW_STEPS, str(ROOT / "configs/quickstart.yaml"),
           f"run.output_dir={out}", *SMALL, *args]
    # the machine dies: every process of the run at once (as under a launcher: no supervisor)
    proc = subprocess.Popen(cmd, env={**ENV, "MEGATHUNDER_SUPERVISE": "0"}, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    latest = out / "checkpoints" / "latest"
    deadline = time.monotonic() + 600
    while not (latest.is_file() and latest.read_text().strip() == "step_2"):
        assert proc.poll() is None, proc.stderr.read().decode()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = train(out, *args, knobs=SLOW_STEPS)
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert [x["step"] for x in rows(out)] == [0, 1, 2, 3]
    steps = [json.loads(line)["rec"] for line in (out / "journal.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in steps if r["type"] == "step") == [0, 1, 2, 3]
    replay(out, tmp_path / "replayed", "sync")
    assert update_error(base / "sft_model", tmp_path / "replayed", out / "final_model") <= UPDATE_RTOL


def _run_children(supervisor_pid: int) -> list[int]:
    """Processes still alive that were started under the supervisor ``supervisor_pid``."""
    import psutil

    alive = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("MEGATHUNDER_SUPERVISOR_PID") == str(supervisor_pid):
                alive.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return alive


def _start_interactive(out: Path, *args: str, shm: Path | None = None, knobs: tuple[str, ...] = ()) -> subprocess.Popen:
    """``megathunder train`` as a person starts it (supervised: no launcher in the environment;
    ``knobs``: ``bench_train`` with them, supervised the same way). ``shm``: as root, the run sees
    this directory as its /dev/shm (a mount namespace of its own, as the chaos soak's runs), so what
    it leaves there is its own, not another job's on the machine."""
    entry = ["megathunder.bench.bench_train", *knobs] if knobs else ["megathunder.cli", "train"]
    cmd = [sys.executable, "-m", *entry, str(ROOT / "configs/quickstart.yaml"), f"run.output_dir={out}", *SMALL, *args]
    if shm is not None:
        shm.mkdir(parents=True, exist_ok=True)
        shm.chmod(0o1777)
        # unshare and sh exec in turn: the pid stays the run's (signals reach it)
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"',
               str(shm), *cmd]
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "MEGATHUNDER_SUPERVISE")}
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class ShmLeaks:
    """What a run leaves in /dev/shm: its own private one where it can have one (root, unshare),
    else the machine's entries new since the start (which another job's may join)."""

    def __init__(self, tmp_path: Path) -> None:
        private = os.geteuid() == 0 and shutil.which("unshare") is not None
        self.dir = tmp_path / "shm" if private else None
        self.before = set() if private else set(os.listdir("/dev/shm"))

    def left(self) -> set[str]:
        if self.dir is not None:
            return set(os.listdir(self.dir))
        return set(os.listdir("/dev/shm")) - self.before


def _wait_for_step(proc: subprocess.Popen, out: Path, step: int) -> None:
    """Until the running run's metrics hold step ``step``'s row (complete lines only: the last one
    may be mid-write)."""
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.is_file() and metrics.read_text().count("\n") > step):
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < deadline, "the run did not reach its step"
        time.sleep(0.2)


# the first Ctrl-C is SIGUSR1's stop: tests/cluster/test_launch.py (checkpoint, requeue, resume); the supervised
# Ctrl-C path: test_a_second_ctrl_c_stops_at_once_and_cleanly
@pytest.mark.slow
def test_ctrl_c_finishes_the_step_checkpoints_and_resumes(base, tmp_path):
    """The first Ctrl-C: the step in progress finishes, a checkpoint is saved, the command says how
    to resume and exits 75, leaving no process and no shared-memory segment; the same command then
    continues from the checkpoint and trains each step once."""
    out = tmp_path / "run"
    args = ["run.num_steps=4", "eval.every_n_steps=0", *warm(base)]
    shm = ShmLeaks(tmp_path)
    proc = _start_interactive(out, *args, shm=shm.dir, knobs=SLOW_STEPS)
    _wait_for_step(proc, out, 0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "the same command resumes from it" in err
    stopped = len(rows(out))
    assert 1 <= stopped < 4 and (out / "checkpoints" / "latest").read_text().strip() == f"step_{stopped}"
    assert _run_children(proc.pid) == []
    assert shm.left() == set()
    resumed = train(out, *args, knobs=SLOW_STEPS)
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert [x["step"] for x in rows(out)] == [0, 1, 2, 3]


VERIFIER_S = 10.0


@pytest.mark.slow  # the first Ctrl-C (finish, checkpoint, resume) is checked in CI; the second's two cases here
def test_a_second_ctrl_c_stops_at_once_and_cleanly(base, tmp_path):
    """The second Ctrl-C lands mid-step: each reward takes VERIFIER_S more, so the step the first
    Ctrl-C asked to finish cannot finish in the 0.2 s before it (a quickstart step is ~0.3 s: it
    did once, and the second Ctrl-C met the run's close instead -- the next test)."""
    out = tmp_path / "run"
    shm = ShmLeaks(tmp_path)
    proc = _start_interactive(out, "run.num_steps=50", "eval.every_n_steps=0", *warm(base), shm=shm.dir,
                              knobs=(f"--verifier-latency={VERIFIER_S}",))  # no evaluation's rewards to wait for
    _wait_for_step(proc, out, 0)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert time.monotonic() - t0 < 60
    assert "Traceback" not in err and "stopped now" in err and "stopped after step" not in err, err[-3000:]
    assert len(rows(out)) < 50
    assert _run_children(proc.pid) == []
    assert shm.left() == set()


@pytest.mark.slow  # as the test above
def test_a_second_ctrl_c_while_the_run_closes_lets_the_close_finish(base, tmp_path):
    """The second Ctrl-C lands right after the first one's checkpoint, while the run closes its
    engine (~4 s of vLLM's shutdown, then ~2 s of the interpreter's): the close finishes, and the
    run exits 75 with the step's checkpoint, leaving no process and no shared-memory segment.
    (It was: an exception raised into vLLM's shutdown, the engine core left running and the run
    hung until the supervisor's kill, -9; or, in the interpreter's finalization, SIGTERM's default
    action, -15.) Wherever in the close the signal lands, the outcome is the same."""
    out = tmp_path / "run"
    shm = ShmLeaks(tmp_path)
    proc = _start_interactive(out, "run.num_steps=50", *warm(base), shm=shm.dir)
    lines: list[str] = []

    def read_stderr() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append(line)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # type: ignore[union-attr]
    _wait_for_step(proc, out, 0)
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 300
    while not any("stopped after step" in line for line in list(lines)):
        if proc.poll() is not None or time.monotonic() > deadline:  # the line may still be in the pipe
            reader.join(timeout=10)
            break
        time.sleep(0.005)
    assert any("stopped after step" in line for line in list(lines)), "".join(lines)[-3000:]
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    proc.wait(timeout=120)
    reader.join(timeout=10)
    err = "".join(lines)
    assert proc.returncode == 75, err[-3000:]
    assert time.monotonic() - t0 < 60
    assert "Traceback" not in err and "stopped now" not in err, err[-3000:]
    stopped = len(rows(out))
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{stopped}"
    assert _run_children(proc.pid) == []
    assert shm.left() == set()
