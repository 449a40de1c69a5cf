"""``megathunder bench chaos``, the short variant: the fault-free quickstart and one chaos run
(``kill_engine``: the in-process engine's engine core and workers SIGKILLed mid-batch, after a
seeded number of trajectories) side by side; the engine is started again in place with the
learner's weights, the requests the death cut off go again with their seeds, and the run ends with
the fault-free run's parameters (within the fp32 summation-order tolerance), leaving no process,
/dev/shm entry, file descriptor or container behind. The 50-run soak is in RELIABILITY.md."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.integration.test_trainer import ENV, ROOT


def test_bench_chaos_short(tmp_path):
    cmd = [sys.executable, "-m", "megathunder.cli", "bench", "chaos", "--runs", "1", "--kinds", "kill_engine",
           "--parallel", "2", "--steps", "2", "--json", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    row = result["table"]["kill_engine"]
    assert (row["runs"], row["survived"], row["lost"], row["claim"]) == (1, 1, 0, "fault_free")
    metrics = [json.loads(line) for line in (tmp_path / "run000_kill_engine" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["engine_restarts"] == 1  # the engine died once and was started again in place
    assert row["max_update_rel"] <= result["tolerance_update_rel"]
    assert result["references_ok"] and result["processes_left"] == [] and result["shm_left"] == 0
    assert result["fds_after"] == result["fds_before"] and result["containers_after"] in (0, None)
