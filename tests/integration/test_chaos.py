"""Faults injected into real runs (``chaos.faults``, ``megathunder.trainer.chaos``).

A full disk: the quickstart writes its run directory on a real 64 MiB tmpfs; after step 1's records
the fault fills it, so step 1's checkpoint meets a real ENOSPC. The run stops with one line naming
the path and the last complete checkpoint, which is intact (``latest`` still names it, the partial
one is removed). With the filler deleted, the same command resumes from that checkpoint, fires no
fault again (``chaos.jsonl``), and its final parameters equal the replay of its journal from the
start, as after any resume."""

from __future__ import annotations

import json
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
