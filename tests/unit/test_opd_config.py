"""Config checks of per-turn OPD on the learner, and the past-K/V layer spec."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from megathunder.config import LearnerConfig


def test_kv_strategies_need_past_kv_attention_and_no_pipeline():
    with pytest.raises(ValidationError, match="core_attention=past_kv"):
        LearnerConfig.model_validate({"opd": {"strategy": "kv_adjoint"}})
    with pytest.raises(ValidationError, match="pipeline_parallel"):
        LearnerConfig.model_validate({"opd": {"strategy": "forward_early"}, "precision": {"core_attention": "past_kv"},
                                      "parallel": {"pipeline_parallel": 2}})
    LearnerConfig.model_validate({"opd": {"strategy": "recompute"}})
    LearnerConfig.model_validate({"opd": {"strategy": "kv_adjoint"}, "precision": {"core_attention": "past_kv"}})


def test_past_kv_spec_replaces_only_the_core_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megathunder.config.schema import PolicyModelConfig, PrecisionConfig
    from megathunder.learner.model import layer_spec
    from megathunder.learner.past_kv import PastKVAttention

    stock = layer_spec(PolicyModelConfig(), PrecisionConfig())
    ours = layer_spec(PolicyModelConfig(), PrecisionConfig(core_attention="past_kv"))
    assert stock.submodules.self_attention.submodules.core_attention is DotProductAttention
    assert ours.submodules.self_attention.submodules.core_attention is PastKVAttention
    assert ours.submodules.self_attention.submodules.linear_qkv is stock.submodules.self_attention.submodules.linear_qkv
    assert ours.submodules.mlp == stock.submodules.mlp
