"""Config checks of per-turn OPD on the learner, and the past-K/V layer spec."""

from __future__ import annotations

from pathlib import Path

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


@pytest.mark.parametrize("overrides, message", [
    (["objective.kind=opd_grpo"], "learner.opd: required when objective.kind is opd_grpo"),
    (["objective.kind=opd_grpo", "learner.opd.strategy=recompute", "schedule.mode=async"], "schedule.mode: "),
    (["objective.kind=opd_grpo", "learner.opd.strategy=recompute", "objective.loss_agg=seq_mean_token_mean"],
     "objective.loss_agg: seq_mean_token_mean cannot be combined"),
    (["objective.kind=opd_grpo", "learner.opd.strategy=recompute", "objective.loss_agg=seq_mean_token_sum"],
     "learner.opd.aggregation: token_mean, but opd_grpo"),
    (["objective.kind=opd_grpo", "learner.opd.strategy=recompute", "objective.kl_coef=0.1"], "objective: DAPO"),
    (["objective.kind=opd_grpo", "learner.opd.strategy=recompute", "verifier.on_failure=drop_group"],
     "verifier.on_failure: drop_group"),
    (["objective.kind=opd_grpo", "learner.opd.strategy=recompute", "learner.opd.divergence=gjsd"],
     "learner.opd.divergence: opd_grpo"),
    (["objective.kind=opd"], "learner.opd: required when objective.kind is opd"),
    (["objective.kind=opd", "learner.opd.strategy=recompute", "schedule.mode=async"], "schedule.mode: "),
    (["objective.kind=opd", "learner.opd.strategy=recompute", "schedule.mode=fully_async"], "schedule.mode: "),
    (["learner.opd.strategy=recompute", "learner.opd.teacher_hf_checkpoint=/t"], "learner.opd.teacher_hf_checkpoint: "),
    (["run.tiny_model.num_kv_heads=3"], "num_kv_heads: 3 does not divide"),
])
def test_training_objective_is_checked_when_parsed(overrides, message):
    from megathunder.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_opd_objective_parses_with_its_teacher():
    from megathunder.config import load_config

    assert load_config(None).objective.kind == "grpo"
    cfg = load_config(None, ["objective.kind=opd", "schedule.mode=sync", "learner.opd.strategy=recompute",
                             "learner.opd.teacher_hf_checkpoint=/ckpt/teacher"])
    assert cfg.learner.opd.teacher_hf_checkpoint == "/ckpt/teacher"
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs/opd_quickstart.yaml")
    assert (cfg.objective.kind, cfg.schedule.mode, cfg.learner.opd.teacher_hf_checkpoint) == ("opd", "thunder", None)
    for mode in ("sync", "thunder"):
        cfg = load_config(None, ["objective.kind=opd_grpo", f"schedule.mode={mode}", "learner.opd.strategy=recompute",
                                 "learner.opd.teacher_hf_checkpoint=/ckpt/teacher"])
        assert (cfg.objective.kind, cfg.schedule.mode) == ("opd_grpo", mode)
