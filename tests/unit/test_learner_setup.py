"""Learner setup errors happen before any process group exists; vocab-parallel math at TP=1."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from megathunder.config import ConfigError, LearnerConfig, ParallelConfig, PolicyModelConfig, load_config
from megathunder.learner.parallel import ParallelDims, init_distributed


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["learner.parallel.tensor_parallel=3"], "learner.parallel.tensor_parallel"),
        (["learner.parallel.tensor_parallel=8", "learner.model.num_attention_heads=8"],
         "learner.parallel.tensor_parallel"),  # 8 does not divide num_query_groups=2
        (["learner.parallel.pipeline_parallel=3"], "learner.parallel.pipeline_parallel"),
        (["learner.precision.fp8=e4m3"], "learner.precision.fp8"),
        (["learner.model.num_query_groups=3"], "learner.model.num_query_groups"),
        (["learner.optimizer.name=sgd"], "learner.optimizer.use_distributed_optimizer"),
        (["learner.optimizer.min_lr=1", "learner.optimizer.lr=0.1"], "learner.optimizer.min_lr"),
    ],
)
def test_bad_learner_configs_fail_at_parse_time(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert f"\n  {field}" in str(err.value)


def test_world_size_must_be_a_product_of_the_layout():
    assert ParallelDims.build(ParallelConfig(tensor_parallel=2, pipeline_parallel=2), 8) == ParallelDims(2, 2, 2)
    with pytest.raises(ConfigError, match="world size 6 is not a multiple"):
        ParallelDims.build(ParallelConfig(tensor_parallel=4), 6)
    with pytest.raises(ConfigError, match="data_parallel: 3"):
        ParallelDims.build(ParallelConfig(tensor_parallel=2, data_parallel=3), 4)


def test_hf_model_that_the_layout_cannot_shard_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    }))
    from megathunder.learner.model import policy_config_from_hf

    model = policy_config_from_hf(tmp_path, PolicyModelConfig())
    assert (model.num_layers, model.num_query_groups, model.head_dim) == (3, 2, 8)
    with pytest.raises(ConfigError, match="pipeline_parallel: 2 does not divide model.num_layers=3"):
        ParallelDims(1, 2, 1).check_model(model)
    with pytest.raises(ConfigError, match="tensor_parallel: 8 does not divide"):
        ParallelDims(8, 1, 1).check_model(model)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type 'gpt2'"):
        policy_config_from_hf(tmp_path, PolicyModelConfig())


def test_transformer_engine_without_cuda_fails_before_any_process_group():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the transformer_engine spec is allowed")
    cfg = LearnerConfig.model_validate({"precision": {"layer_spec": "transformer_engine"}})
    with pytest.raises(ConfigError, match="transformer_engine needs CUDA"):
        init_distributed(cfg)
    assert not dist.is_initialized()


def test_fp8_settings_reach_megatron_transformer_config():
    """The TE/FP8 path is configuration on CPU: check what would be handed to TransformerConfig."""
    from megathunder.config import PrecisionConfig
    from megathunder.learner.model import transformer_config
    from megathunder.learner.parallel import ProcessGroups

    pgs = ProcessGroups(ParallelDims(1, 1, 1), 0, 1, 0, 0, 0, None, torch.device("cpu"))
    precision = PrecisionConfig(layer_spec="transformer_engine", fp8="hybrid", fp8_recipe="delayed",
                                fp8_margin=1, fp8_amax_history_len=16, fp8_amax_compute_algo="most_recent")
    cfg = transformer_config(PolicyModelConfig(), precision, pgs)
    assert (cfg.fp8, cfg.fp8_recipe, cfg.fp8_margin, cfg.fp8_amax_history_len, cfg.fp8_amax_compute_algo) == (
        "hybrid", "delayed", 1, 16, "most_recent")
    assert transformer_config(PolicyModelConfig(), PrecisionConfig(), pgs).fp8 is None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vocab_parallel_logprobs_single_rank_match_log_softmax(temperature):
    """At the sampling temperature T the learner's distribution is softmax(z / T), vLLM's."""
    from megathunder.learner.logprobs import vocab_parallel_logprobs

    torch.manual_seed(0)
    logits = torch.randn(7, 50, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (7,))
    logp, entropy = vocab_parallel_logprobs(logits, targets, None, need_entropy=True, temperature=temperature)
    ref = torch.log_softmax(logits / temperature, -1)
    torch.testing.assert_close(logp, ref.gather(-1, targets[:, None])[:, 0])
    torch.testing.assert_close(entropy, -(ref.exp() * ref).sum(-1))
    g1 = torch.autograd.grad((logp.sum() + entropy.sum()), logits)[0]
    g2 = torch.autograd.grad((ref.gather(-1, targets[:, None]).sum() - (ref.exp() * ref).sum()), logits)[0]
    torch.testing.assert_close(g1, g2)


def test_cpu_adam_takes_torchs_fused_kernel_with_the_same_update():
    """Without TE/Apex megatron-core steps with torch's Adam(W), whose CPU default is the
    single-tensor loop; ``_fused_torch_adam`` switches the wrapped optimizer to the fused kernel.
    Same update: one fp32 step from the same state agrees to a few ulp (the fused arithmetic rounds
    once per element where the loop rounds per operation)."""
    from types import SimpleNamespace

    import torch

    from megathunder.learner.learner import _fused_torch_adam

    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    grads = [torch.randn_like(p) * 1e-3 for p in start]

    def stepped(fused: bool) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
        if fused:
            _fused_torch_adam(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=opt)]))
            assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
        for _ in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in params]

    loop, fused = stepped(False), stepped(True)
    assert not torch.equal(loop[0], start[0])  # the steps moved the weights
    for a, b in zip(loop, fused, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
