"""Memory options are validated at parse time, naming the field (sequence and context parallelism,
recompute, the SDPA attention, bounded OPD state); context parallelism refuses a CPU learner before
any process group exists."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megathunder.config import ConfigError, LearnerConfig, load_config


@pytest.mark.parametrize("overrides,field,words", [
    (["learner.parallel.sequence_parallel=true"], "learner.parallel.sequence_parallel", "tensor_parallel > 1"),
    (["learner.parallel.context_parallel=2"], "learner.parallel.context_parallel", "transformer_engine"),
    (["learner.parallel.context_parallel=2", "learner.precision.layer_spec=transformer_engine",
      "learner.precision.core_attention=sdpa"], "learner.parallel.context_parallel", "core_attention=sdpa"),
    (["learner.activations.recompute=selective", "learner.precision.core_attention=past_kv"],
     "learner.activations.recompute", "past keys/values"),
    (["learner.activations.recompute=partial"], "learner.activations.recompute", ""),
    (["learner.activations.recompute_modules=[moe]"], "learner.activations.recompute_modules", ""),
    (["objective.kind=opd", "learner.parallel.tensor_parallel=2", "learner.parallel.sequence_parallel=true",
      "learner.precision.core_attention=past_kv"], "learner.parallel.sequence_parallel", "one model call"),
    (["objective.kind=opd", "objective.max_cached_trajectories=-1"], "objective.max_cached_trajectories", ""),
    (["learner.precision.core_attention=flash"], "learner.precision.core_attention", ""),
    (["learner.parallel.context_parallel=2", "learner.precision.layer_spec=transformer_engine",
      "learner.parallel.cp_comm_type=a2a", "learner.model.num_attention_heads=4", "learner.parallel.tensor_parallel=2"],
     "learner.parallel.context_parallel", "num_query_groups=2"),
])
def test_memory_options_are_checked_at_parse_time(overrides, field, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert field in str(err.value) and words in str(err.value), str(err.value)


def test_valid_memory_options_parse():
    cfg = load_config(None, ["learner.parallel.tensor_parallel=2", "learner.parallel.sequence_parallel=true",
                             "learner.precision.core_attention=sdpa", "learner.activations.recompute=full",
                             "learner.activations.recompute_method=block", "learner.activations.recompute_num_layers=1",
                             "ledger.slot_dtype=bfloat16", "ledger.slot_placement=host", "ledger.slot_budget_gb=8"])
    assert cfg.learner.activations.recompute == "full" and cfg.ledger.slot_placement == "host"


def test_recompute_layers_must_fit_a_stage_when_the_model_is_built():
    from megathunder.learner.model import build_gpt_model
    from megathunder.learner.parallel import ParallelDims, ProcessGroups

    pgs = ProcessGroups(ParallelDims(1, 1, 1), 0, 1, 0, 0, 0, None, torch.device("cpu"))
    cfg = LearnerConfig.model_validate({"activations": {"recompute": "full", "recompute_num_layers": 3}})
    with pytest.raises(ConfigError, match="recompute_num_layers: 3 does not divide the 2 layers"):
        build_gpt_model(cfg.model, cfg.precision, pgs, cfg.activations)
    cfg = LearnerConfig.model_validate({"activations": {"recompute": "full", "recompute_method": "block",
                                                        "recompute_num_layers": 3}})
    with pytest.raises(ConfigError, match="recompute_num_layers: 3 exceeds the 2 layers"):
        build_gpt_model(cfg.model, cfg.precision, pgs, cfg.activations)


def test_context_parallel_without_cuda_fails_before_any_process_group():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    from megathunder.learner.parallel import ParallelDims, init_distributed

    cfg = LearnerConfig.model_validate({"parallel": {"context_parallel": 2},
                                        "precision": {"layer_spec": "transformer_engine"}})
    with pytest.raises(ConfigError, match="needs CUDA"):
        init_distributed(cfg)
    assert not dist.is_initialized()
    dims = ParallelDims.build(cfg.parallel, 8)  # world = TP x PP x CP x DP
    assert (dims.tp, dims.pp, dims.cp, dims.dp) == (1, 1, 2, 4) and dims.seq_multiple == 4
    with pytest.raises(ConfigError, match="context_parallel = 1 x 1 x 2"):
        ParallelDims.build(cfg.parallel, 7)


def test_transformer_config_receives_sp_recompute_and_cp():
    from megathunder.config import ActivationsConfig, PolicyModelConfig, PrecisionConfig
    from megathunder.learner.model import transformer_config
    from megathunder.learner.parallel import ParallelDims, ProcessGroups

    pgs = ProcessGroups(ParallelDims(2, 1, 1, cp=1, sp=True), 0, 2, 0, 0, 0, None, torch.device("cpu"))
    cfg = transformer_config(PolicyModelConfig(), PrecisionConfig(), pgs, ActivationsConfig(recompute="selective"))
    assert cfg.sequence_parallel and cfg.recompute_granularity == "selective" and cfg.recompute_modules == ["core_attn"]
    pgs = ProcessGroups(ParallelDims(1, 1, 2, cp=2, cp_comm_type="a2a"), 0, 4, 0, 0, 0, None, torch.device("cpu"))
    cfg = transformer_config(PolicyModelConfig(), PrecisionConfig(layer_spec="transformer_engine"), pgs,
                             ActivationsConfig(recompute="full", recompute_method="block", recompute_num_layers=1))
    assert (cfg.context_parallel_size, cfg.cp_comm_type) == (2, "a2a")
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "block", 1)


def test_auto_attention_is_the_fused_one_of_each_spec():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megathunder.config import PolicyModelConfig, PrecisionConfig
    from megathunder.learner.model import layer_spec
    from megathunder.learner.sdpa_attention import SDPAttention

    assert PrecisionConfig().core_attention == "auto" and PrecisionConfig().attention == "sdpa"
    assert PrecisionConfig(layer_spec="transformer_engine").attention == "megatron"
    assert PrecisionConfig(core_attention="megatron").attention == "megatron"
    core = {name: layer_spec(PolicyModelConfig(), PrecisionConfig(core_attention=name))
            .submodules.self_attention.submodules.core_attention for name in ("auto", "megatron")}
    assert core == {"auto": SDPAttention, "megatron": DotProductAttention}
    # context parallelism (Transformer Engine's attention) is what auto means on the TE spec
    cfg = load_config(None, ["learner.parallel.context_parallel=2", "learner.precision.layer_spec=transformer_engine"])
    assert cfg.learner.precision.attention == "megatron"
