"""``megathunder plan`` against CUDA's max allocated memory, run by ``tools/gpu_check.sh``; skipped on
CPU. One GPU, bf16 parameters: ledger slots fp32 / bf16 / in host memory, the unfused attention
with selective recompute, SDPA with full recompute at 32k tokens, and Transformer Engine's layers
when installed (``megathunder bench memory --device cuda``: each layout's prediction within 15% of
the measured peak)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_plan_predicts_the_peak_cuda_memory_of_each_layout_within_15_percent():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "megathunder.cli", "bench", "memory", "--device", "cuda"],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    print(proc.stdout[-4000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["device"] == "cuda" and len(result["rows"]) >= 5
    assert proc.returncode == 0 and result["max_abs_error"] <= 0.15, result["rows"]
