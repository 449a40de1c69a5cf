"""``megathunder bench chaos``, the short variant: the fault-free quickstart and two chaos runs side
by side -- ``kill_engine`` (the in-process engine's engine core and workers SIGKILLed mid-batch,
after a seeded number of trajectories) and ``hang_engine`` (SIGSTOPped instead: it fails nothing,
and is found by progress, no token computed for ``rollout.engine.stall_timeout_s``, then killed).
Both times the engine is started again in place with the learner's weights, the requests the
death cut off go again with their seeds, and the run ends with the fault-free run's parameters
(within the fp32 summation-order tolerance), leaving no process, /dev/shm entry, file descriptor
or container behind. The 50-run soak is in RELIABILITY.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.test_trainer import ENV, ROOT

KINDS = ("kill_engine", "hang_engine")


@pytest.mark.slow  # the soak's own plumbing; each fault kind's claim is checked faster by test_chaos.py and tests/unit/test_chaos_*.py
def test_bench_chaos_short(tmp_path):
    cmd = [sys.executable, "-m", "megathunder.cli", "bench", "chaos", "--runs", "2", "--kinds", *KINDS,
           "--parallel", "2", "--steps", "2", "--json", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for kind in KINDS:  # the kinds are drawn in rounds: one run of each
        row = result["table"][kind]
        assert (row["runs"], row["survived"], row["lost"], row["claim"]) == (1, 1, 0, "fault_free"), (kind, row)
        assert row["max_update_rel"] <= result["tolerance_update_rel"]
        [run_dir] = tmp_path.glob(f"run*_{kind}")
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert metrics[-1]["engine_restarts"] == 1, kind  # the engine died (or was killed as hung) once, restarted
    assert result["references_ok"] and result["processes_left"] == [] and result["shm_left"] == 0
    assert result["fds_after"] == result["fds_before"] and result["containers_after"] in (0, None)
