"""``megathunder bench chaos``, the short variant: the fault-free quickstart and one chaos run
(``hang_sandbox`` on seeded random trajectories: a tool call that the real local sandbox stops at
its wall time) side by side; the run survives in place and ends with the fault-free run's
parameters (within the fp32 summation-order tolerance), and leaves no process, /dev/shm entry,
file descriptor or container behind. The 50-run soak is in RELIABILITY.md."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.integration.test_trainer import ENV, ROOT


def test_bench_chaos_short(tmp_path):
    cmd = [sys.executable, "-m", "megathunder.cli", "bench", "chaos", "--runs", "1", "--kinds", "hang_sandbox",
           "--parallel", "2", "--steps", "2", "--json", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    row = result["table"]["hang_sandbox"]
    assert (row["runs"], row["survived"], row["lost"], row["claim"]) == (1, 1, 0, "fault_free")
    assert row["max_update_rel"] <= result["tolerance_update_rel"]
    assert result["references_ok"] and result["processes_left"] == [] and result["shm_left"] == 0
    assert result["fds_after"] == result["fds_before"] and result["containers_after"] in (0, None)
