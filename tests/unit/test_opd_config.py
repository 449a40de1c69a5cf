"""Config checks of per-turn OPD on the learner, and the past-K/V layer spec."""

from __future__ import annotations

from pathlib import Path

import pytest

def test_kv_strategies_need_past_kv_attention_and_distillation_no_pipeline():
    from megathunder.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="objective.strategy: kv_adjoint needs learner.precision.core_attention=past_kv"):
        load_config(None, ["objective.kind=opd"])
    with pytest.raises(ConfigError, match="learner.parallel.pipeline_parallel: objective.kind=opd runs each turn"):
        load_config(None, ["objective.kind=opd", "objective.strategy=recompute",
                           "learner.precision.core_attention=past_kv", "learner.parallel.pipeline_parallel=2",
                           "learner.model.num_layers=2"])
    load_config(None, ["objective.kind=opd", "objective.strategy=recompute"])
    load_config(None, ["objective.kind=opd", "learner.precision.core_attention=past_kv"])


def test_past_kv_spec_replaces_only_the_core_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megathunder.config import PolicyModelConfig, PrecisionConfig
    from megathunder.learner.model import layer_spec
    from megathunder.learner.past_kv import PastKVAttention

    stock = layer_spec(PolicyModelConfig(), PrecisionConfig(core_attention="megatron"))
    ours = layer_spec(PolicyModelConfig(), PrecisionConfig(core_attention="past_kv"))
    assert stock.submodules.self_attention.submodules.core_attention is DotProductAttention
    assert ours.submodules.self_attention.submodules.core_attention is PastKVAttention
    assert ours.submodules.self_attention.submodules.linear_qkv is stock.submodules.self_attention.submodules.linear_qkv
    assert ours.submodules.mlp == stock.submodules.mlp


RECOMPUTE = "objective.strategy=recompute"


@pytest.mark.parametrize("overrides, message", [
    (["objective.kind=opd_grpo", RECOMPUTE, "schedule.mode=async"], "schedule.mode: "),
    (["objective.kind=opd_grpo", RECOMPUTE, "objective.loss_agg=seq_mean_token_mean"],
     "objective.loss_agg: seq_mean_token_mean cannot be combined"),
    (["objective.kind=opd_grpo", RECOMPUTE, "objective.kl_coef=0.1"], "objective.kl_coef: KL-to-reference"),
    (["objective.kind=opd_grpo", RECOMPUTE, "objective.dapo_dynamic_sampling=true"], "objective.dapo_dynamic_sampling: "),
    (["objective.kind=opd_grpo", RECOMPUTE, "verifier.on_failure=drop_group"], "verifier.on_failure: drop_group"),
    (["objective.kind=opd_grpo", RECOMPUTE, "objective.divergence=gjsd"],
     "objective.divergence: not a field of objective.kind=opd_grpo"),
    (["objective.kind=opd", RECOMPUTE, "schedule.mode=async"], "schedule.mode: "),
    (["objective.kind=opd", RECOMPUTE, "schedule.mode=fully_async"], "schedule.mode: "),
    (["objective.kind=opd", RECOMPUTE, "objective.kl_coef=0.1"], "objective.kl_coef: not a field of objective.kind=opd"),
    (["objective.teacher.hf_checkpoint=/t"], "objective.teacher: not a field of objective.kind=grpo"),
    (["objective.kind=bogus"], "objective.kind: 'bogus' is not one of 'grpo', 'opd', 'opd_grpo'"),
    (["run.tiny_model.num_kv_heads=3"], "num_kv_heads: 3 does not divide"),
])
def test_training_objective_is_checked_when_parsed(overrides, message):
    from megathunder.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_opd_objective_parses_with_its_teacher():
    from megathunder.config import load_config

    assert load_config(None).objective.kind == "grpo"
    cfg = load_config(None, ["objective.kind=opd", "schedule.mode=sync", RECOMPUTE,
                             "objective.teacher.hf_checkpoint=/ckpt/teacher"])
    assert cfg.objective.teacher.hf_checkpoint == "/ckpt/teacher" and cfg.objective.needs_teacher
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs/opd_quickstart.yaml")
    assert (cfg.objective.kind, cfg.schedule.mode, cfg.objective.teacher.hf_checkpoint) == ("opd", "thunder", None)
    for mode in ("sync", "thunder"):
        cfg = load_config(None, ["objective.kind=opd_grpo", f"schedule.mode={mode}", RECOMPUTE,
                                 "objective.teacher.hf_checkpoint=/ckpt/teacher"])
        assert (cfg.objective.kind, cfg.schedule.mode) == ("opd_grpo", mode)
        assert (cfg.objective.aggregation, cfg.objective.divergence) == ("token_mean", "reverse_kl")
