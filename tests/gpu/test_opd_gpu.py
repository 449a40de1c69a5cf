"""Per-turn OPD on the Megatron learner on a GPU (``tools/gpu_check.sh``); skipped on CPU.

One process, CUDA + NCCL, bf16 parameters with fp32 gradient buffers, the past-K/V core attention
in the local spec and (when Transformer Engine is installed) in the TE spec: the streamed
per-turn gradient equals batch OPD on the full trajectories within bf16 tolerance.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF16_TOL = 3e-2


def _run(layer_spec: str) -> dict[str, float]:
    from megathunder.config import LearnerConfig, OPDObjective
    from megathunder.learner.batches import opd_streamer
    from megathunder.learner.learner import MegatronLearner
    from megathunder.learner.segment_model import MegatronSegmentModel
    from megathunder.learner.parallel import destroy_distributed, init_distributed
    from megathunder.objectives.opd import opd_normaliser
    from megathunder.streaming.opd_turns import FunctionTeacher, accumulate_full_trajectory_opd
    from tests.opd_helpers import flatten, random_episode, stream

    os.environ.setdefault("MASTER_PORT", "29556")
    cfg = LearnerConfig.model_validate({
        "model": {"vocab_size": 1024, "hidden_size": 512, "ffn_hidden_size": 2048, "num_layers": 4,
                  "num_attention_heads": 8, "num_query_groups": 4, "tie_word_embeddings": False},
        "precision": {"params_dtype": "bfloat16", "layer_spec": layer_spec, "core_attention": "past_kv"},
    })
    objective = OPDObjective(strategy="kv_adjoint")
    pgs = init_distributed(cfg)

    def teacher_fn(tokens, start, end):  # any fixed function of the tokens will do for exactness
        return -((tokens[start:end].double() * 0.37) % 3.0).float() - 0.1

    try:
        learner = MegatronLearner.build(cfg, objective, pgs)
        rng = random.Random(0)
        episodes = [random_episode(rng, 1024) for _ in range(6)]
        full = [flatten(e) for e in episodes]
        seg = MegatronSegmentModel(learner.ddp, pgs)
        learner.ddp.zero_grad_buffer()
        items = [(t, m, teacher_fn(t, 1, t.numel())) for t, m in full]
        counts, _ = accumulate_full_trajectory_opd(seg, items, 1.0)
        learner.backend.live.div_(opd_normaliser(counts, "token_mean"))
        reference = learner.backend.live.flat().float().clone()
        errors = {}
        for strategy in ("recompute", "kv_adjoint", "forward_early"):
            objective.strategy = strategy
            streamer = opd_streamer(learner, FunctionTeacher(teacher_fn))
            stream(streamer, episodes)
            streamer.finish_batch()
            streamed = learner.backend.live.flat().float()
            errors[strategy] = ((streamed - reference).norm() / reference.norm()).item()
        return errors
    finally:
        destroy_distributed()


@pytest.mark.gpu
def test_per_turn_opd_bf16_local_spec():
    errors = _run("local")
    assert all(e <= BF16_TOL for e in errors.values()), errors


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="Transformer Engine not installed")
def test_per_turn_opd_bf16_transformer_engine_spec():
    errors = _run("transformer_engine")
    assert all(e <= BF16_TOL for e in errors.values()), errors
