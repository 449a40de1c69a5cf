"""The policy as megatron-core ``GPTModel``: Llama / Qwen2 / Qwen3 decoders and Qwen3-MoE.

All four families are RMSNorm + SwiGLU + RoPE + grouped-query attention; they differ in
biases (Qwen2 has q/k/v biases), q/k RMSNorm (Qwen3, Qwen3-MoE) and tied embeddings (small Qwen
models). Qwen3-MoE replaces every layer's MLP with Megatron's ``MoELayer`` (the local spec's
``get_gpt_layer_local_spec(num_experts=...)``: ``TopKRouter`` + ``SequentialMLP`` experts + the
all-gather token dispatcher), the same function as transformers' sparse block: transformers takes
softmax over all experts, the top k, and (``norm_topk_prob``) divides by their sum; Megatron's
default takes the top k logits and a softmax over them, which is the same number
(exp(l_i) / sum_{j in top k} exp(l_j)) -- and with ``norm_topk_prob: false`` Megatron's
``moe_router_pre_softmax`` is transformers' order exactly. The router runs in fp32 as transformers'
does. The top-k choice itself is discrete: a token whose k-th and (k+1)-th router logits are within
rounding of each other may be routed differently by two summation orders (layouts, engines), so
the tests use models whose gaps are far from rounding (``megathunder.models.tiny_hf``).
The layer spec is Megatron's ``local`` spec (CPU and GPU) or Transformer Engine's (GPU; required
for FP8, whose format and recipe are passed to TE through ``TransformerConfig``), either with its
own core attention, with ours on torch's fused ``scaled_dot_product_attention``
(``megathunder.learner.sdpa_attention``: memory linear in the length) or with ours over past
keys/values (``megathunder.learner.past_kv``). Activation memory: Megatron's sequence parallelism
and activation recomputation (selective, full) and, on the TE spec, context parallelism, passed
through ``TransformerConfig``.

RoPE scaling (``PolicyModelConfig.rope_scaling``, read from the checkpoint's config.json) is
mapped to Megatron's own mechanisms, so the learner's positions are vLLM's and transformers':
linear = ``seq_len_interpolation_factor``; llama3 = Megatron's Llama 3 frequency scaling, called
with the checkpoint's low/high frequency factors and original length; yarn = Megatron's YaRN
embedding (frequencies and attention factor; an explicit factor becomes Megatron's ``mscale``).
``tests/distributed/test_learner.py`` checks each against transformers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from megathunder.config import (
    ActivationsConfig,
    ConfigError,
    MoEConfig,
    PolicyModelConfig,
    PrecisionConfig,
    RopeScalingConfig,
)
from megathunder.learner.parallel import ProcessGroups
from megathunder.learner.past_kv import with_past_kv_attention
from megathunder.learner.sdpa_attention import SDPAttention, with_core_attention
from megathunder.learner.sp_norm import with_sequence_parallel_norms

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def policy_config_from_hf(hf_dir: str | Path, base: PolicyModelConfig) -> PolicyModelConfig:
    """Sizes from a Hugging Face ``config.json`` (model_type llama, qwen2, qwen3, qwen3_moe, qwen2_moe
    or mixtral)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"learner.model.hf_checkpoint: no config.json in {hf_dir}")
    hf = json.loads(path.read_text())
    family = hf.get("model_type")
    if family not in ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"):
        raise ConfigError(
            f"learner.model.hf_checkpoint: model_type {family!r} in {path} is not one of llama, qwen2, qwen3, "
            "qwen3_moe, qwen2_moe, mixtral"
        )
    if family in ("llama", "mixtral") and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise ConfigError(f"learner.model.hf_checkpoint: {family} with attention/mlp biases is not supported")
    if family == "qwen2_moe" and (hf.get("use_sliding_window") or hf.get("qkv_bias") is False):
        raise ConfigError(f"learner.model.hf_checkpoint: {path} sets use_sliding_window or qkv_bias: false, which "
                          "the learner's Qwen2-MoE (full attention, q/k/v biases) does not reproduce")
    if family == "mixtral" and hf.get("sliding_window") is not None:
        raise ConfigError(f"learner.model.hf_checkpoint: {path} sets sliding_window, which the learner's attention "
                          "does not reproduce")
    heads = hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return base.model_copy(update=dict(
        **moe_sizes_from_hf(hf, path),
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_position_embeddings=hf.get("max_position_embeddings", base.max_position_embeddings),
        rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling_from_hf(rope, path),
        norm_eps=hf.get("rms_norm_eps", base.norm_eps),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    ))


def moe_sizes_from_hf(hf: dict, path: Path) -> dict:
    """The MoE fields of a Qwen3-MoE, Qwen2-MoE or Mixtral ``config.json`` (nothing for a dense family).
    Layouts Megatron's uniform MoE block does not reproduce are refused by name: dense layers among
    sparse ones (``mlp_only_layers``, ``decoder_sparse_step`` > 1), router jitter."""
    no_shared = dict(moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False)
    if hf.get("model_type") == "mixtral":  # every layer sparse, top-k always renormalised
        if hf.get("router_jitter_noise"):
            raise ConfigError(f"learner.model.hf_checkpoint: {path} sets router_jitter_noise (random routing), "
                              "which an exact learner cannot reproduce")
        return dict(num_experts=hf["num_local_experts"], moe_router_topk=hf["num_experts_per_tok"],
                    moe_ffn_hidden_size=hf["intermediate_size"], moe_norm_topk_prob=True, **no_shared)
    if hf.get("model_type") not in ("qwen3_moe", "qwen2_moe"):
        return {"num_experts": None}
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"learner.model.hf_checkpoint: {path} mixes dense and sparse layers (mlp_only_layers / "
                          "decoder_sparse_step), which the learner does not reproduce")
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if not experts:
        raise ConfigError(f"learner.model.hf_checkpoint: {path} names no num_experts")
    shared = no_shared
    if hf["model_type"] == "qwen2_moe":  # every layer also has a shared expert, gated by sigmoid(w . x)
        shared = dict(moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
                      moe_shared_expert_gate=True)
    return dict(num_experts=experts, moe_router_topk=hf["num_experts_per_tok"],
                moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_norm_topk_prob=bool(hf.get("norm_topk_prob")),
                **shared)


def rope_scaling_from_hf(rope: dict, path: Path) -> RopeScalingConfig | None:
    """The ``rope_scaling`` / ``rope_parameters`` of a config.json; a kind Megatron cannot reproduce
    is refused by name (the learner would rotate positions differently from vLLM)."""
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("linear", "llama3", "yarn"):
        raise ConfigError(f"learner.model.hf_checkpoint: rope scaling {kind!r} in {path} is not supported "
                          "(linear, llama3 and yarn are)")
    known = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "beta_fast",
             "beta_slow", "attention_factor", "truncate")
    unknown = sorted(set(rope) - set(known) - {"rope_type", "type", "rope_theta"})
    if unknown:  # e.g. yarn's mscale / mscale_all_dim (DeepSeek's variant)
        raise ConfigError(f"learner.model.hf_checkpoint: rope scaling {kind!r} in {path} sets {', '.join(unknown)}, "
                          "which the learner does not reproduce")
    return RopeScalingConfig(kind=kind, **{k: rope[k] for k in known if rope.get(k) is not None})


def moe_fields(model: PolicyModelConfig, moe: MoEConfig, pgs: ProcessGroups) -> dict:
    """``TransformerConfig``'s MoE fields for this model (empty for a dense one)."""
    if model.num_experts is None:
        return {}
    on_gpu = pgs.device.type == "cuda"
    if moe.grouped_gemm and not on_gpu:
        raise ConfigError("learner.moe.grouped_gemm: needs CUDA (grouped GEMM kernels); false runs SequentialMLP")
    if moe.token_dispatcher == "alltoall" and not on_gpu:
        raise ConfigError("learner.moe.token_dispatcher: alltoall needs CUDA streams; allgather runs on CPU")
    return dict(
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.expert_ffn_hidden_size,
        moe_router_pre_softmax=not model.moe_norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",  # transformers' router softmax is fp32
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=model.moe_shared_expert_gate,
        moe_router_load_balancing_type=moe.load_balancing_type,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff or None,
        moe_grouped_gemm=moe.grouped_gemm,
        moe_token_dispatcher_type=moe.token_dispatcher,
        expert_model_parallel_size=pgs.dims.ep,
        expert_tensor_parallel_size=pgs.dims.etp,
        moe_enable_routing_replay=moe.routing_replay,  # each router gets a RouterReplay (routing_replay.py)
    )


def transformer_config(model: PolicyModelConfig, precision: PrecisionConfig, pgs: ProcessGroups,
                       activations: ActivationsConfig | None = None, moe: MoEConfig | None = None):
    """Megatron's ``TransformerConfig`` of this model, layout and precision; ``activations``: the
    recompute settings (none for forward-only models: the reference, the teacher); ``moe``: how
    a mixture of experts is trained (default ``MoEConfig()``: no router losses)."""
    from megatron.core.transformer import TransformerConfig

    dtype = DTYPES[precision.params_dtype]
    on_gpu = pgs.device.type == "cuda"
    fp8 = {}
    if precision.fp8 is not None:
        fp8 = dict(
            fp8=precision.fp8,
            fp8_recipe=precision.fp8_recipe,
            fp8_margin=precision.fp8_margin,
            fp8_amax_history_len=precision.fp8_amax_history_len,
            fp8_amax_compute_algo=precision.fp8_amax_compute_algo,
        )
    memory: dict = {}
    if pgs.dims.sp:
        memory["sequence_parallel"] = True
    if pgs.dims.cp > 1:
        memory.update(context_parallel_size=pgs.dims.cp, cp_comm_type=pgs.dims.cp_comm_type)
    if activations is not None and activations.recompute == "selective":
        memory.update(recompute_granularity="selective", recompute_modules=list(activations.recompute_modules))
    elif activations is not None and activations.recompute == "full":
        memory.update(recompute_granularity="full", recompute_method=activations.recompute_method,
                      recompute_num_layers=activations.recompute_num_layers)
    kv_channels = model.head_dim or model.hidden_size // model.num_attention_heads
    rope = model.rope_scaling
    config = TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=kv_channels,
        layernorm_epsilon=model.norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=pgs.dims.tp,
        pipeline_model_parallel_size=pgs.dims.pp,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=False,
        masked_softmax_fusion=on_gpu,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=True,  # DP reduction sums the ranks' partial gradients
        **fp8,
        **memory,
        **moe_fields(model, moe or MoEConfig(), pgs),
    )
    if rope is not None and rope.kind == "yarn":  # read by GPTModel's YaRN embedding (not config fields)
        config.yarn_rotary_scaling_factor = rope.factor
        config.yarn_original_max_position_embeddings = (
            rope.original_max_position_embeddings or model.max_position_embeddings)
        config.yarn_beta_fast, config.yarn_beta_slow = rope.beta_fast, rope.beta_slow
        # Megatron's attention factor is 0.1 * mscale * ln(factor) + 1 (mscale_all_dim 0): transformers'
        # default with mscale 1; a checkpoint's explicit factor m needs mscale = (m - 1) / (0.1 ln(factor))
        m = rope.attention_factor
        config.yarn_mscale = (m - 1.0) / (0.1 * math.log(rope.factor)) if m is not None and rope.factor > 1 else 1.0
        config.yarn_mscale_all_dim = 0.0
        config.yarn_correction_range_round_to_int = rope.truncate
    return config


def layer_spec(model: PolicyModelConfig, precision: PrecisionConfig, sequence_parallel: bool = False,
               num_layers: int | None = None, grouped_gemm: bool = False, router_losses: bool = False):
    """The GPT layer spec: local or Transformer Engine, with Megatron's core attention or ours
    (``sdpa``: torch's fused kernels; ``past_kv``: also attends to a cache of past keys/values
    with autograd, for per-turn OPD). The local spec under sequence parallelism becomes a block
    spec of ``num_layers`` layers with SP-aware norms (``megathunder.learner.sp_norm``)."""
    qk_norm = model.qk_norm
    experts = model.num_experts
    if experts is not None:
        _megatron_moe_without_te()
    if precision.layer_spec == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=grouped_gemm,
                                                          qk_layernorm=qk_norm)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=grouped_gemm, qk_layernorm=qk_norm,
                                        normalization="RMSNorm")
    if router_losses:  # per-trajectory seq_aux / z losses (megathunder.learner.router_losses)
        from megathunder.learner.router_losses import LedgerRouter

        spec.submodules.mlp.submodules.router = LedgerRouter
    if precision.attention == "past_kv":
        spec = with_past_kv_attention(spec)
    elif precision.attention == "sdpa":
        spec = with_core_attention(spec, SDPAttention)
    if sequence_parallel and precision.layer_spec == "local":
        assert num_layers is not None, "the local spec under sequence parallelism needs the stage's layer count"
        spec = with_sequence_parallel_norms(spec, num_layers)
    return spec


def _megatron_moe_without_te() -> None:
    """megatron-core 0.16's router gating reads ``te_general_gemm``, which its module defines only
    when Transformer Engine imports (a NameError otherwise): without TE it is None, and the router
    takes its own torch matmul branch."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def resolve_model_config(model: PolicyModelConfig, hf_dir: str | Path | None) -> PolicyModelConfig:
    """The model's sizes: ``hf_dir``'s config.json when given, else ``model``'s own."""
    return model if hf_dir is None else policy_config_from_hf(hf_dir, model)


def build_gpt_model(model_cfg: PolicyModelConfig, precision: PrecisionConfig, pgs: ProcessGroups,
                    activations: ActivationsConfig | None = None, moe: MoEConfig | None = None):
    """The GPTModel chunk of this pipeline stage (weights randomly initialised)."""
    from megatron.core.models.gpt import GPTModel

    pgs.dims.check_model(model_cfg)
    if activations is not None and activations.recompute == "full":
        per_stage, n = model_cfg.num_layers // pgs.dims.pp, activations.recompute_num_layers
        if activations.recompute_method == "block" and n > per_stage:
            raise ConfigError(f"learner.activations.recompute_num_layers: {n} exceeds the {per_stage} layers of a "
                              "pipeline stage")
        if activations.recompute_method == "uniform" and per_stage % n:
            raise ConfigError(f"learner.activations.recompute_num_layers: {n} does not divide the {per_stage} layers "
                              "of a pipeline stage (recompute_method=uniform)")
    config = transformer_config(model_cfg, precision, pgs, activations, moe)
    rope = model_cfg.rope_scaling
    position: dict = {"position_embedding_type": "rope"}
    if rope is not None and rope.kind == "linear":
        position["seq_len_interpolation_factor"] = rope.factor
    elif rope is not None and rope.kind == "yarn":
        position["position_embedding_type"] = "yarn"
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(model_cfg, precision, pgs.dims.sp, model_cfg.num_layers // pgs.dims.pp,
                                          grouped_gemm=moe is not None and moe.grouped_gemm,
                                          router_losses=model_cfg.is_moe and moe is not None and moe.router_losses),
        vocab_size=model_cfg.vocab_size,
        max_sequence_length=model_cfg.max_position_embeddings,
        pre_process=pgs.is_first_stage,
        post_process=pgs.is_last_stage,
        share_embeddings_and_output_weights=model_cfg.tie_word_embeddings,
        rotary_base=int(model_cfg.rope_theta) if float(model_cfg.rope_theta).is_integer() else model_cfg.rope_theta,
        pg_collection=pgs.collection,
        **position,
    )
    if rope is not None and rope.kind == "llama3":  # Megatron's own scaling, with this checkpoint's constants
        emb = model.rotary_pos_emb  # built unscaled (rope_scaling=False): scale its frequencies once
        emb.inv_freq = emb._apply_scaling(emb.inv_freq, factor=rope.factor, low_freq_factor=rope.low_freq_factor,
                                          high_freq_factor=rope.high_freq_factor,
                                          original_max_position_embeddings=rope.original_max_position_embeddings or 8192)
    return model.to(pgs.device)


def layer_offset(model_cfg: PolicyModelConfig, pgs: ProcessGroups) -> int:
    """Global index of this stage's first transformer layer (layers split evenly)."""
    return pgs.pp_rank * (model_cfg.num_layers // pgs.dims.pp)
