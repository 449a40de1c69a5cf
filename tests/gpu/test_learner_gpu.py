"""GPU checks of the learner, run by ``tools/gpu_check.sh`` on a CUDA machine; skipped on CPU.

Single process, CUDA + NCCL, bf16 parameters with fp32 gradient buffers: the streamed gradient
equals the batch-synchronous one within bf16 tolerance, with the local spec and (when Transformer
Engine is installed) the TE spec and FP8.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF16_TOL = 2e-2  # relative; bf16 forward/backward, fp32 accumulation, reassociated sums


DENSE = {"vocab_size": 1024, "hidden_size": 512, "ffn_hidden_size": 2048, "num_layers": 4,
         "num_attention_heads": 8, "num_query_groups": 4, "tie_word_embeddings": False}
MOE = {**DENSE, "family": "qwen3_moe", "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 512}


def _run(layer_spec: str, fp8: str | None, model: dict = DENSE) -> tuple[float, float]:
    from megathunder.streaming import synthetic as syn
    from megathunder.trajectory import batch_plan
    from megathunder.config import GRPOObjective, LearnerConfig, LedgerConfig
    from megathunder.learner.batches import grpo_gradient
    from megathunder.learner.learner import MegatronLearner
    from megathunder.learner.parallel import destroy_distributed, init_distributed

    os.environ.setdefault("MASTER_PORT", "29555")
    cfg = LearnerConfig.model_validate({
        "model": model,
        "precision": {"params_dtype": "bfloat16", "layer_spec": layer_spec, "fp8": fp8},
    })
    objective = GRPOObjective(kl_coef=0.0, entropy_coef=0.001)
    pgs = init_distributed(cfg)
    try:
        learner = MegatronLearner.build(cfg, objective, pgs, LedgerConfig(max_group_slots=2))
        rng = random.Random(0)
        batch = syn.random_batch(rng, [4, 4, 4], 1024, 256, empty_prob=0.0)
        rewards = syn.random_rewards(rng, batch, "continuous")
        grpo_gradient(learner, batch, rewards)
        sync = learner.backend.live.flat().float().clone()
        ledger = learner.ledger
        ledger.begin_batch(batch_plan(batch))
        syn.feed_events(ledger, batch, rewards, syn.random_event_order(rng, len(batch)))
        ledger.close_batch()
        streamed = learner.backend.live.flat().float()
        return ((streamed - sync).norm() / sync.norm()).item(), sync.norm().item()
    finally:
        destroy_distributed()


@pytest.mark.gpu
def test_streamed_equals_sync_bf16_local_spec():
    err, norm = _run("local", None)
    assert norm > 0 and err <= BF16_TOL, err


@pytest.mark.gpu
def test_streamed_equals_sync_bf16_moe_local_spec():
    """Megatron's MoE layers on CUDA (8 experts, top-2, SequentialMLP, all-gather dispatcher; EP 1
    on one device): the same per-trajectory forward in both paths, so the same routing."""
    err, norm = _run("local", None, MOE)
    assert norm > 0 and err <= BF16_TOL, err


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="Transformer Engine not installed")
@pytest.mark.parametrize("fp8", [None, "hybrid"])
def test_streamed_equals_sync_transformer_engine(fp8):
    err, norm = _run("transformer_engine", fp8)
    assert norm > 0 and err <= (BF16_TOL if fp8 is None else 5e-2), err
