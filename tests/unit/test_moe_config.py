"""Mixture-of-experts settings are validated at parse time, naming the field: the expert layout
(expert_parallel x expert_tensor_parallel = tensor_parallel, experts divisible, SP under TP), a dense
model refusing expert parallelism, router losses' fields (only the per-sequence load-balancing loss and the
z-loss, which decompose over trajectories); a Qwen3-MoE config.json is read into the
model's MoE fields, and layouts the learner does not reproduce are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from megathunder.config import ConfigError, PolicyModelConfig, load_config
from megathunder.learner.model import policy_config_from_hf

QUICKSTART_MOE = Path(__file__).resolve().parents[2] / "configs" / "quickstart_moe.yaml"
MOE = ["learner.model.family=qwen3_moe", "learner.model.num_experts=4", "learner.model.moe_ffn_hidden_size=32"]


@pytest.mark.parametrize("overrides,field,words", [
    (["learner.parallel.tensor_parallel=2", "learner.parallel.sequence_parallel=true",
      "learner.parallel.expert_parallel=3"], "learner.parallel.expert_parallel", "do not divide one another"),
    ([*MOE, "learner.parallel.expert_parallel=2", "learner.parallel.data_parallel=3"],
     "learner.parallel.expert_parallel", "does not divide data_parallel=3"),
    ([*MOE, "learner.parallel.expert_parallel=2", "learner.parallel.pipeline_parallel=2"],
     "learner.parallel.expert_parallel", "pipeline_parallel > 1"),
    (["learner.parallel.tensor_parallel=2", "learner.parallel.sequence_parallel=true",
      "learner.parallel.expert_parallel=2"], "learner.parallel.expert_parallel", "dense model"),
    ([*MOE, "learner.parallel.tensor_parallel=2", "learner.parallel.expert_parallel=2"],
     "learner.parallel.sequence_parallel", "needs sequence parallelism"),
    ([*MOE, "learner.parallel.tensor_parallel=4", "learner.parallel.sequence_parallel=true",
      "learner.parallel.expert_parallel=2", "learner.parallel.expert_tensor_parallel=1"],
     "learner.parallel.expert_tensor_parallel", "must be a multiple of tensor_parallel=4"),
    (["learner.model.family=qwen3_moe", "learner.model.num_experts=5", "learner.parallel.tensor_parallel=2",
      "learner.parallel.sequence_parallel=true", "learner.parallel.expert_parallel=2"],
     "learner.parallel.expert_parallel", "num_experts=5"),
    ([*MOE, "learner.parallel.tensor_parallel=2", "learner.parallel.sequence_parallel=true",
      "learner.model.moe_ffn_hidden_size=33"], "learner.parallel.expert_tensor_parallel", "moe_ffn_hidden_size=33"),
    (["learner.model.num_experts=4"], "learner.model.num_experts", "family=qwen2"),
    ([*MOE, "learner.model.moe_router_topk=5"], "learner.model.moe_router_topk", "exceeds num_experts=4"),
    (["learner.moe.aux_loss_coeff=0.01"], "learner.moe.aux_loss_coeff", "load_balancing_type"),
    (["learner.moe.load_balancing_type=aux_loss", "learner.moe.aux_loss_coeff=0.01"],
     "learner.moe.load_balancing_type", "each micro-batch's tokens together"),
    (["learner.moe.load_balancing_type=global_aux_loss", "learner.moe.aux_loss_coeff=0.01"],
     "learner.moe.load_balancing_type", "use seq_aux_loss"),
    ([*MOE, "learner.moe.z_loss_coeff=0.001", "learner.activations.recompute=full"], "learner.moe.aux_loss_coeff",
     "run the routers again"),
    (["learner.moe.token_dispatcher=flex"], "learner.moe.token_dispatcher", ""),
    (["learner.moe.routing_replay=true", "schedule.mode=async"], "learner.moe.routing_replay", "sync or thunder"),
    (["learner.moe.routing_replay=true", "learner.activations.recompute=full"], "learner.moe.routing_replay",
     "run the routers again"),
    (["learner.moe.grouped_gemm=true"], "learner.moe.grouped_gemm", "bf16 only"),  # the legacy GroupedMLP
])
def test_moe_settings_are_checked_at_parse_time(overrides, field, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert field in str(err.value) and words in str(err.value), str(err.value)


def test_valid_expert_layouts_parse():
    for ep, etp in ((2, 1), (1, 2)):
        cfg = load_config(None, [*MOE, "learner.parallel.tensor_parallel=2", "learner.parallel.sequence_parallel=true",
                                 f"learner.parallel.expert_parallel={ep}"])
        assert cfg.learner.parallel.expert_tensor_parallel_size == etp
    across = load_config(None, [*MOE, "learner.parallel.expert_parallel=2"]).learner.parallel  # EP drawn from DP
    assert (across.expert_tensor_parallel_size, across.expert_data_span) == (1, 2)
    assert load_config(None, []).learner.moe.aux_loss_coeff == 0.0  # RL gradient: the policy's only
    moe = load_config(None, [*MOE, "learner.moe.load_balancing_type=seq_aux_loss", "learner.moe.aux_loss_coeff=0.01",
                             "learner.moe.z_loss_coeff=0.001"]).learner.moe
    assert moe.router_losses  # the per-sequence loss and the z-loss are exact under the ledger
    assert not load_config(None, ["learner.moe.load_balancing_type=aux_loss"]).learner.moe.router_losses  # coeff 0
    for spec in (["learner.precision.params_dtype=bfloat16"], ["learner.precision.layer_spec=transformer_engine"]):
        assert load_config(None, ["learner.moe.grouped_gemm=true", *spec]).learner.moe.grouped_gemm  # both mapped


def test_routing_replay_turns_on_the_engines_recorder():
    cfg = load_config(QUICKSTART_MOE, [])
    assert cfg.learner.moe.routing_replay and cfg.rollout.engine.record_routing
    assert not load_config(None, []).rollout.engine.record_routing


def _config_json(tmp_path, **extra):
    config = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "moe_intermediate_size": 16, "num_experts_per_tok": 2, "norm_topk_prob": True, **extra}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("experts_key", ["num_experts", "num_local_experts"])
def test_qwen3_moe_config_json_is_read(tmp_path, experts_key):
    m = policy_config_from_hf(_config_json(tmp_path, **{experts_key: 8}), PolicyModelConfig())
    assert (m.family, m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_norm_topk_prob) == (
        "qwen3_moe", 8, 2, 16, True)


def test_mixed_dense_and_sparse_layers_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="mixes dense and sparse layers"):
        policy_config_from_hf(_config_json(tmp_path, num_experts=8, mlp_only_layers=[0]), PolicyModelConfig())


def test_the_tiny_moe_quickstart_takes_expert_parallelism():
    cfg = load_config(QUICKSTART_MOE, ["learner.parallel.tensor_parallel=2",
                                                       "learner.parallel.sequence_parallel=true",
                                                       "learner.parallel.expert_parallel=2"])
    assert cfg.run.tiny_model.num_experts == 4
    with pytest.raises(ConfigError, match="learner.parallel.expert_parallel: 2 does not divide run.tiny_model.num_experts=5"):
        load_config(QUICKSTART_MOE, ["run.tiny_model.num_experts=5", "learner.parallel.tensor_parallel=2",
                                                     "learner.parallel.sequence_parallel=true",
                                                     "learner.parallel.expert_parallel=2"])


def test_mixtral_config_json_is_read_and_jitter_refused(tmp_path):
    config = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    m = policy_config_from_hf(tmp_path, PolicyModelConfig())
    assert (m.family, m.num_experts, m.moe_router_topk, m.expert_ffn_hidden_size, m.moe_norm_topk_prob) == (
        "mixtral", 8, 2, 48, True)
    (tmp_path / "config.json").write_text(json.dumps({**config, "router_jitter_noise": 0.1}))
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        policy_config_from_hf(tmp_path, PolicyModelConfig())


def test_qwen2_moe_config_json_is_read_with_its_gated_shared_expert(tmp_path):
    config = {"model_type": "qwen2_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
              "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
              "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True,
              "use_sliding_window": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    m = policy_config_from_hf(tmp_path, PolicyModelConfig())
    assert (m.family, m.num_experts, m.expert_ffn_hidden_size, m.moe_norm_topk_prob) == ("qwen2_moe", 8, 16, False)
    assert (m.moe_shared_expert_intermediate_size, m.moe_shared_expert_gate, m.qkv_bias, m.qk_norm) == (
        24, True, True, False)
    for bad in ({"use_sliding_window": True}, {"qkv_bias": False}):
        (tmp_path / "config.json").write_text(json.dumps({**config, **bad}))
        with pytest.raises(ConfigError, match="use_sliding_window or qkv_bias"):
            policy_config_from_hf(tmp_path, PolicyModelConfig())
    with pytest.raises(ValidationError, match="moe_shared_expert_gate: needs moe_shared_expert_intermediate_size"):
        PolicyModelConfig(family="qwen2_moe", num_experts=4, moe_shared_expert_gate=True)
