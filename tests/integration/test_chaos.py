"""Faults injected into real runs (``chaos.faults``, ``megathunder.trainer.chaos``).

A full disk: the quickstart writes its run directory on a real 64 MiB tmpfs; after step 1's records
the fault fills it, so step 1's checkpoint meets a real ENOSPC. The run stops with one line naming
the path and the last complete checkpoint, which is intact (``latest`` still names it, the partial
one is removed). With the filler deleted, the same command resumes from that checkpoint, fires no
fault again (``chaos.jsonl``), and its final parameters equal the replay of its journal from the
start, as after any resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_trainer import ENV, ROOT, SMALL, UPDATE_RTOL, replay, rows, update_error


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _train(out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megathunder.cli", "train", str(ROOT / "configs/quickstart.yaml"),
           f"run.output_dir={out}", *SMALL, "eval.every_n_steps=0", "run.num_steps=3", "sft.num_steps=4",
           "run.wandb=disabled", "run.checkpoint_every=1", "ledger.pack_ready_work=false",
           "chaos.faults=[{kind: fill_disk, step: 1}]"]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_a_full_disk_stops_the_run_in_one_line_and_the_same_command_resumes(small_disk, tmp_path):
    out = small_disk / "run"
    first = _train(out)
    assert first.returncode == 1, first.stderr[-3000:]
    ours = [line for line in first.stderr.splitlines() if line.startswith("megathunder: ")]
    assert len(ours) == 1, first.stderr[-3000:]  # one line (after it only vLLM's shutdown warnings)
    last = ours[0]
    assert last.startswith("megathunder: no space left on device writing ") and "step_2.tmp" in last, last
    assert "the last complete one, step_1, is intact" in last
    assert "Traceback" not in first.stderr
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_1" and (ckpts / "step_1").is_dir()
    assert not (ckpts / "step_2.tmp").exists()  # the partial checkpoint gave its space back

    (out / ".chaos_fill").unlink()
    second = _train(out)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout + second.stderr
    assert [r["step"] for r in rows(out)] == [0, 1, 2]
    fired = [json.loads(line) for line in (out / "chaos.jsonl").read_text().splitlines()]
    assert [f["kind"] for f in fired] == ["fill_disk"]  # not again on resume
    replay(out, tmp_path / "sync", "sync")
    assert update_error(out / "sft_model", tmp_path / "sync", out / "final_model") <= UPDATE_RTOL


# hang detection and regroup: tests/unit/test_rollout_server_faults.py (SIGSTOPped servers under load)
@pytest.mark.slow
def test_a_rollout_server_hung_mid_batch_is_left_out_and_the_run_goes_on(tmp_path):
    """Two vLLM servers; ``hang_server`` SIGSTOPs one while the batch generates. The hang detector
    finds it by progress, its requests finish on the other server with their seeds, and the next push
    re-opens the weight-transfer groups (collective, the default) without it: every step trains, the
    probe stays clean, no policy lag."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megathunder.cli", "train", str(ROOT / "configs/quickstart.yaml"),
           f"run.output_dir={out}", *SMALL, "eval.every_n_steps=0", "run.num_steps=2", "sft.num_steps=4",
           "run.wandb=disabled", "rollout.engine.deployment=server", "rollout.engine.num_servers=2",
           "rollout.engine.base_port=18560", "rollout.engine.stall_timeout_s=5",
           "chaos.faults=[{kind: hang_server, step: 0, after_trajectories: 2, server: 1}]"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    log = proc.stdout + proc.stderr
    assert "18561 lost (TimeoutError: hung:" in log and "re-opening the weight-transfer groups" in log
    r = rows(out)
    assert [x["step"] for x in r] == [0, 1] and all(x["policy_lag_max"] == 0 for x in r)
    assert all(0 <= x["probe_gap"] <= 1e-3 for x in r)
    assert all(x["num_failed"] == 0 for x in r)  # nothing lost with the server


def _quick(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megathunder.cli", "train", str(ROOT / "configs/quickstart.yaml"),
           f"run.output_dir={out}", *SMALL, "eval.every_n_steps=0", "sft.num_steps=4", "run.wandb=disabled",
           "ledger.pack_ready_work=false", *overrides]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.slow  # 131 s; in CI: verifier faults on the real sandbox (tests/unit/test_chaos_episodes.py), a torn record dropped by its CRC (tests/unit/test_journal.py), resume equal to replay (test_trainer.py's kill and resume); and the chaos soak
def test_verifier_and_journal_faults_in_a_real_run_equal_its_journal_replay(tmp_path):
    """Step 0: trajectory 1's verifier raises, trajectory 5's hangs past verifier.timeout_s (both get
    on_failure's zero reward, in the journal); after step 1 the journal's last record (step 1's own)
    is torn and the run stops as a crash would, before step 1's checkpoint. The same command resumes
    from step 1's start (no fault fires again): the CRC drops the torn record, step 1 runs again, and
    the run equals the replay of its journal. (A tool fault takes an episode's own bash call: the
    quickstart has none, and refuses it -- tests/unit/test_chaos_episodes.py runs them on the real
    sandbox.)"""
    out = tmp_path / "run"
    args = ("run.num_steps=3", "run.checkpoint_every=1", "verifier.timeout_s=2",
            "chaos.faults=[{kind: crash_verifier, step: 0, trajectories: [1]}, "
            "{kind: hang_verifier, step: 0, trajectories: [5]}, {kind: corrupt_journal, step: 1}]")
    first = _quick(out, *args)
    assert first.returncode == 130, first.stdout[-3000:] + first.stderr[-5000:]
    ours = [line for line in first.stderr.splitlines() if line.startswith("megathunder: ")]
    assert len(ours) == 1 and ours[0].startswith("megathunder: chaos: corrupt_journal: tore"), first.stderr[-3000:]
    assert "Traceback" not in first.stderr
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_1"

    second = _quick(out, *args)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout + second.stderr and "chaos:" not in second.stderr
    assert [r["step"] for r in rows(out)] == [0, 1, 2]
    recs = [json.loads(line)["rec"] for line in (out / "journal.jsonl").read_text().splitlines()]
    failures = {(r["step"], r["traj_id"]): r["failure"] for r in recs if r["type"] == "trajectory" and r["failure"]}
    assert set(failures) == {(0, 1), (0, 5)}, failures
    assert "chaos: crash_verifier" in failures[0, 1] and failures[0, 5].startswith("verifier_timeout")
    assert [r["metrics"]["num_failed"] for r in recs if r["type"] == "step"] == [0, 0, 0]  # zero_reward: trained
    fired = [json.loads(line)["kind"] for line in (out / "chaos.jsonl").read_text().splitlines()]
    assert sorted(fired) == ["corrupt_journal", "crash_verifier", "hang_verifier"]
    replay(out, tmp_path / "sync", "sync")
    assert update_error(out / "sft_model", tmp_path / "sync", out / "final_model") <= UPDATE_RTOL


# the fast checks: tests/unit/test_engine_hang.py (each update call guarded: a hung core killed after the stall
# timeout, a dead one failing the pending call, a long load timed only while a process is stopped); ~3-5 min here
@pytest.mark.slow
def test_an_engine_core_hung_or_killed_inside_a_weight_update_stops_the_run_in_one_line_and_it_resumes(tmp_path):
    """The in-process engine's core is SIGSTOPped as step 1's weight push begins (``hang_engine``,
    ``during: weight_update``): its pause never answers; after ``stall_timeout_s`` the core is
    SIGKILLed and the run stops in one line (exit 1) instead of waiting forever. The same command
    resumes; as step 2's push begins the core is SIGKILLed (``kill_engine``): the update fails at
    once, one line again. The same command resumes a second time, fires neither fault again, and
    its final parameters equal the replay of its journal from the start."""
    out = tmp_path / "run"
    args = ("run.num_steps=3", "run.checkpoint_every=1", "rollout.engine.stall_timeout_s=3",
            "chaos.faults=[{kind: hang_engine, step: 1, during: weight_update}, "
            "{kind: kill_engine, step: 2, during: weight_update}]")
    for why in ("hung", "died"):
        stopped = _quick(out, *args)
        assert stopped.returncode == 1, stopped.stdout[-2000:] + stopped.stderr[-5000:]
        ours = [line for line in stopped.stderr.splitlines() if line.startswith("megathunder: ")]
        assert len(ours) == 1 and f"engine {why} inside a weight update (pause)" in ours[0], stopped.stderr[-3000:]
        assert "Traceback" not in stopped.stderr, stopped.stderr[-5000:]
    done = _quick(out, *args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "chaos:" not in done.stderr  # neither fault fired again
    assert [r["step"] for r in rows(out)] == [0, 1, 2]
    fired = [json.loads(line)["kind"] for line in (out / "chaos.jsonl").read_text().splitlines()]
    assert fired == ["hang_engine", "kill_engine"]
    replay(out, tmp_path / "sync", "sync")
    assert update_error(out / "sft_model", tmp_path / "sync", out / "final_model") <= UPDATE_RTOL


# the learner kinds' fast checks: tests/distributed/test_rank_hang.py, test_rank_loss.py (the fault sent, the
# rank dying or stopping, rank 0 naming it) and tests/unit/test_chaos_config.py; this is the real run (~8 min)
@pytest.mark.slow
def test_learner_ranks_killed_and_hung_in_a_real_run_stop_it_and_it_resumes_to_its_journal_replay(tmp_path):
    """Two learner ranks under torchrun (DP = 2), vLLM, 3 steps, a checkpoint after each. Step 1:
    rank 1 SIGKILLs itself (``kill_learner``); the run stops (rank 0 names the dead rank, or
    torchrun ends it first). The same command resumes from step 1's start; step 2: rank 1
    SIGSTOPs itself (``hang_learner``), rank 0's watchdog names it within
    ``heartbeat_timeout_s`` and the run stops again. The same command resumes once more, fires
    neither fault again, and its final parameters equal the replay of its journal from the start
    (one process, sync)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "megathunder.cli", "train", str(ROOT / "configs/quickstart.yaml"), f"run.output_dir={out}", *SMALL,
           "eval.every_n_steps=0", "sft.num_steps=4", "run.wandb=disabled", "ledger.pack_ready_work=false",
           "run.num_steps=3", "run.checkpoint_every=1", "learner.watchdog.heartbeat_timeout_s=5",
           "chaos.faults=[{kind: kill_learner, step: 1, after_trajectories: 4, rank: 1}, "
           "{kind: hang_learner, step: 2, after_trajectories: 4, rank: 1}]"]

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900, cwd=ROOT)

    killed = run()
    assert killed.returncode != 0, killed.stdout[-2000:] + killed.stderr[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_1", killed.stderr[-3000:]
    assert [json.loads(line)["kind"] for line in (out / "chaos.jsonl").read_text().splitlines()] == ["kill_learner"]

    hung = run()
    assert hung.returncode != 0, hung.stdout[-2000:] + hung.stderr[-3000:]
    assert "rank 1 hung (no heartbeat for" in hung.stderr, hung.stderr[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_2"

    done = run()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "chaos:" not in done.stderr  # neither fault fired again
    assert [r["step"] for r in rows(out)] == [0, 1, 2]
    replay(out, tmp_path / "sync", "sync")
    assert update_error(out / "sft_model", tmp_path / "sync", out / "final_model") <= UPDATE_RTOL


@pytest.mark.skipif(os.geteuid() != 0, reason="as root the local sandbox refuses a root_dir its uids cannot reach")
def test_a_batch_none_of_whose_sandboxes_can_be_set_up_stops_the_run_in_one_line(tmp_path):
    """The SWE-style set's warm start runs its scripted episodes in sandboxes; with a sandbox root its
    uids cannot traverse (mode 0700) none can be set up: the run stops in one line naming the cause
    (exit 1), not a traceback."""
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)
    cmd = [sys.executable, "-m", "megathunder.cli", "train", str(ROOT / "configs/swe_local.yaml"),
           f"run.output_dir={tmp_path / 'run'}", "sft.num_steps=1", "run.wandb=disabled",
           f"sandbox.root_dir={hidden}"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if line.startswith("megathunder: ")]
    assert len(ours) == 1 and ours[0].startswith("megathunder: no sandbox of the batch could be set up"), ours
    assert "is not traversable by other users" in ours[0] and "Traceback" not in proc.stderr
