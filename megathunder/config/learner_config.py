"""The learner's section (``learner``): Megatron-core parallel layout, the policy model, precision,
optimizer and the frozen reference model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from megathunder import cpu_cores
from megathunder.config.base import Strict


MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


class ParallelConfig(Strict):
    """Megatron parallel layout. world size = tensor x pipeline x context x data (data inferred if
    null)."""

    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)
    context_parallel: int = Field(1, ge=1)
    """Each trajectory's sequence split over this many ranks (Megatron's load-balanced 2 x CP
    chunks; attention through Transformer Engine, so GPUs and layer_spec=transformer_engine only)."""
    data_parallel: int | None = Field(None, ge=1)
    sequence_parallel: bool = False
    """Megatron sequence parallelism: the activations outside the tensor-parallel matmuls (norms,
    residuals, the layer inputs) are split along the sequence over the TP ranks instead of
    replicated. Needs tensor_parallel > 1; each trajectory is padded to a multiple of TP."""
    cp_comm_type: Literal["p2p", "all_gather", "a2a", "a2a+p2p"] = "p2p"
    """How context-parallel ranks exchange keys and values (Transformer Engine)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl with CUDA, gloo without."""
    expert_parallel: int = Field(1, ge=1)
    """MoE models: the routed experts of each layer are split over this many ranks (Megatron's
    expert parallelism; each rank holds num_experts / expert_parallel whole experts and tokens are
    dispatched to them). The expert grid expert_parallel x expert_tensor_parallel is a multiple of
    tensor_parallel: equal to it, the experts are split over the ranks of one tensor-parallel group,
    which run the same trajectory at the same time; k times it, the grid also spans k
    data-parallel ranks (Megatron's usual layout, EP drawn from DP), and those k ranks run every
    trajectory together, as one data-parallel unit (the ledger's per-trajectory backwards need the
    ranks that exchange tokens in lockstep: ``megathunder.learner.parallel``), so experts are
    sharded k times further at the price of k-fold dense compute; k must divide the data-parallel
    size. Under tensor parallelism MoE needs sequence_parallel (Megatron's rule for training)."""
    expert_tensor_parallel: int | None = Field(None, ge=1)
    """MoE models: each expert's matrices split over this many ranks (Megatron's expert-tensor
    parallelism, like a dense MLP under TP); null = tensor_parallel / expert_parallel where
    expert_parallel divides tensor_parallel, else 1. Must divide tensor_parallel."""

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError("sequence_parallel: needs tensor_parallel > 1 (it splits the sequence over the TP ranks)")
        tp, ep = self.tensor_parallel, self.expert_parallel
        if tp % ep and ep % tp:
            raise ValueError(f"expert_parallel: {ep} and tensor_parallel={tp} do not divide one another (the expert "
                             "grid is one tensor-parallel group, or whole groups of several data-parallel ranks)")
        etp = self.expert_tensor_parallel_size
        if tp % etp:
            raise ValueError(f"expert_tensor_parallel: {etp} does not divide tensor_parallel={tp}")
        if (etp * ep) % tp:
            raise ValueError(f"expert_tensor_parallel: {etp} x expert_parallel={ep} must be a multiple of "
                             f"tensor_parallel={tp}")
        span = self.expert_data_span
        if span > 1 and self.data_parallel is not None and self.data_parallel % span:
            raise ValueError(f"expert_parallel: the expert grid {ep} x {etp} spans {span} data-parallel ranks, which "
                             f"does not divide data_parallel={self.data_parallel}")
        if span > 1 and self.pipeline_parallel > 1:
            raise ValueError(f"expert_parallel: an expert grid spanning data-parallel ranks ({ep} x {etp} > "
                             f"tensor_parallel={tp}) is not supported with pipeline_parallel > 1 yet")
        return self

    @property
    def expert_tensor_parallel_size(self) -> int:
        """expert_tensor_parallel, or tensor_parallel / expert_parallel when that divides, else 1."""
        if self.expert_tensor_parallel is not None:
            return self.expert_tensor_parallel
        tp, ep = self.tensor_parallel, self.expert_parallel
        return tp // ep if tp % ep == 0 else 1

    @property
    def expert_data_span(self) -> int:
        """How many data-parallel ranks one expert grid spans (1: it is one tensor-parallel group)."""
        return self.expert_parallel * self.expert_tensor_parallel_size // self.tensor_parallel


class RopeScalingConfig(Strict):
    """RoPE scaling of a Hugging Face model (its config.json's ``rope_scaling`` / ``rope_parameters``),
    mapped to Megatron: ``linear`` (positions / factor: Megatron's ``seq_len_interpolation_factor``),
    ``llama3`` (Llama 3.1 / 3.2: low frequencies / factor, a smooth ramp between), ``yarn`` (Megatron's
    YaRN embedding, with its attention factor). Other kinds (dynamic NTK, longrope) and unknown keys
    (yarn's mscale / mscale_all_dim) are refused by name when a model is read."""

    kind: Literal["linear", "llama3", "yarn"]
    factor: float = Field(gt=0)
    original_max_position_embeddings: int | None = Field(None, ge=1)
    """llama3 and yarn: the context length the model was trained at before scaling."""
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    beta_fast: float = Field(32.0, gt=0)
    beta_slow: float = Field(1.0, gt=0)
    attention_factor: float | None = Field(None, gt=0)
    """yarn: the factor cos and sin are multiplied by; null = 0.1 * ln(factor) + 1."""
    truncate: bool = True
    """yarn: round the frequency ramp's bounds to integers (transformers' default)."""


class PolicyModelConfig(Strict):
    """A decoder of the Llama / Qwen2 / Qwen3 / Qwen3-MoE / Qwen2-MoE / Mixtral family as
    Megatron-core GPTModel."""

    family: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"] = "qwen2"
    """llama: no biases; qwen2: q/k/v biases; qwen3: q/k RMSNorm, no biases; qwen3_moe: Qwen3's
    attention with a mixture of experts in every layer (``num_experts`` set); qwen2_moe: Qwen2's
    attention (q/k/v biases) with a mixture of experts and a sigmoid-gated shared expert in every
    layer; mixtral: Llama's attention with a mixture of experts in every layer (top-k renormalised)."""
    hf_checkpoint: str | None = None
    """A Hugging Face model directory on disk; its config.json replaces the sizes below."""
    vocab_size: int = Field(256, ge=2)
    hidden_size: int = Field(64, ge=1)
    ffn_hidden_size: int = Field(128, ge=1)
    num_layers: int = Field(2, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_query_groups: int = Field(2, ge=1)
    head_dim: int | None = Field(None, ge=1)
    """Per-head size; null = hidden_size / num_attention_heads."""
    max_position_embeddings: int = Field(2048, ge=1)
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScalingConfig | None = None
    norm_eps: float = Field(1e-6, gt=0)
    tie_word_embeddings: bool = True
    num_experts: int | None = Field(None, ge=2)
    """MoE (family qwen3_moe or mixtral): routed experts per layer (HF ``num_experts`` /
    ``num_local_experts``); null: a dense MLP."""
    moe_router_topk: int = Field(2, ge=1)
    """MoE: experts per token (HF ``num_experts_per_tok``)."""
    moe_ffn_hidden_size: int | None = Field(None, ge=1)
    """MoE: each expert's SwiGLU width (HF ``moe_intermediate_size``); null = ffn_hidden_size."""
    moe_norm_topk_prob: bool = True
    """MoE: the router's weights are softmax over the top-k logits, i.e. the top-k probabilities
    renormalised to sum to 1 (HF ``norm_topk_prob: true``, Megatron's default top-k-then-softmax);
    false: the top-k entries of the softmax over all experts (Megatron's ``moe_router_pre_softmax``)."""
    moe_shared_expert_intermediate_size: int | None = Field(None, ge=1)
    """MoE: width of a shared expert every token also goes through (Megatron's shared experts; HF
    Qwen2-MoE's ``shared_expert_intermediate_size``); null: none (Qwen3-MoE and Mixtral have none)."""
    moe_shared_expert_gate: bool = False
    """MoE: the shared expert's output is scaled by sigmoid(w . x), a learned [1, hidden] gate
    (Qwen2-MoE's ``shared_expert_gate``; Megatron's ``moe_shared_expert_gate``)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def qkv_bias(self) -> bool:
        """Whether q/k/v projections have biases (the Qwen2 families)."""
        return self.family in ("qwen2", "qwen2_moe")

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys are RMS-normalised per head (the Qwen3 families)."""
        return self.family in ("qwen3", "qwen3_moe")

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @model_validator(mode="after")
    def _check(self) -> PolicyModelConfig:
        if (self.family in MOE_FAMILIES) != (self.num_experts is not None):
            raise ValueError(f"num_experts: {self.num_experts} with family={self.family} (the MoE families "
                             f"{', '.join(MOE_FAMILIES)}, and only they, have experts)")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise ValueError("moe_shared_expert_gate: needs moe_shared_expert_intermediate_size (a shared expert)")
        if self.num_experts is not None and self.moe_router_topk > self.num_experts:
            raise ValueError(f"moe_router_topk: {self.moe_router_topk} exceeds num_experts={self.num_experts}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_query_groups: {self.num_query_groups} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"head_dim: required when hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        return self


class PrecisionConfig(Strict):
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    layer_spec: Literal["local", "transformer_engine"] = "local"
    """local: Megatron's own layers (CPU and GPU); transformer_engine: TE layers (GPU only)."""
    core_attention: Literal["auto", "megatron", "sdpa", "past_kv"] = "auto"
    """auto: a fused attention whatever the spec -- sdpa on the local spec, megatron on Transformer
    Engine's; megatron: the layer spec's own core attention (the local spec's is unfused: it stores
    s x s scores per head, 2.6x slower than sdpa on 800-token CPU passes; Transformer Engine's is
    fused and the one context parallelism needs); sdpa: ours on torch's
    ``scaled_dot_product_attention`` (flash / memory-efficient kernels: memory linear in the
    length, without Transformer Engine); past_kv: sdpa that also attends to a cache of past
    keys/values with autograd (needed by the per-turn OPD strategies kv_adjoint and forward_early;
    same math as the others on a whole sequence)."""
    fp8: Literal["e4m3", "hybrid"] | None = None
    """FP8 format for TE linear layers; hybrid = e4m3 forward, e5m2 backward."""
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] = "delayed"
    """mxfp8 needs Blackwell (sm_100+)."""
    fp8_margin: int = Field(0, ge=0)
    fp8_amax_history_len: int = Field(1024, ge=1)
    fp8_amax_compute_algo: Literal["max", "most_recent"] = "max"

    @property
    def attention(self) -> Literal["megatron", "sdpa", "past_kv"]:
        """The core attention the model is built with: ``core_attention`` with auto resolved."""
        if self.core_attention == "auto":
            return "sdpa" if self.layer_spec == "local" else "megatron"
        return self.core_attention

    @model_validator(mode="after")
    def _check(self) -> PrecisionConfig:
        if self.fp8 is not None and self.layer_spec != "transformer_engine":
            raise ValueError("fp8: needs layer_spec=transformer_engine (FP8 runs in TE's layers)")
        return self


class ActivationsConfig(Strict):
    """Activation memory: Megatron's activation recomputation (``TransformerConfig``'s
    ``recompute_*`` fields, passed through)."""

    recompute: Literal["none", "selective", "full"] = "none"
    """none: every activation kept for the backward; selective: the ``recompute_modules`` of each
    layer are recomputed in the backward (core attention by default: the s x s part of an unfused
    attention); full: only each recomputed layer's input is kept, the layer is run again in the
    backward."""
    recompute_method: Literal["uniform", "block"] = "uniform"
    """full: uniform checkpoints every ``recompute_num_layers`` layers; block recomputes the first
    ``recompute_num_layers`` layers of each pipeline stage and keeps the rest."""
    recompute_num_layers: int = Field(1, ge=1)
    """full: layers per checkpoint (uniform) or layers recomputed per stage (block)."""
    recompute_modules: list[Literal["core_attn", "mlp", "layernorm"]] = ["core_attn"]
    """selective: which parts of each layer are recomputed."""


class LearnerOptimizerConfig(Strict):
    name: Literal["adam", "sgd"] = "adam"
    """adam is AdamW (decoupled weight decay), as in Megatron."""
    lr: float = Field(1e-5, gt=0)
    min_lr: float = Field(0.0, ge=0)
    lr_warmup_steps: int = Field(0, ge=0)
    lr_decay_steps: int | None = Field(None, ge=1)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    sgd_momentum: float = Field(0.9, ge=0, lt=1)
    """SGD's momentum (torch's: buf = momentum * buf + grad); Megatron's default."""
    clip_grad: float = Field(1.0, ge=0)
    """Global grad-norm clip; 0 disables it."""
    use_distributed_optimizer: bool = True

    @model_validator(mode="after")
    def _check(self) -> LearnerOptimizerConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr: {self.min_lr} exceeds lr={self.lr}")
        if self.name == "sgd" and self.use_distributed_optimizer:
            raise ValueError("use_distributed_optimizer: Megatron's distributed optimizer supports adam only")
        return self


class ReferenceModelConfig(Strict):
    """Frozen copy of the initial policy, for the KL term (built only when objective.kl_coef > 0)."""

    offload_to_cpu: bool = False
    """Keep its weights in host memory between uses (GPU only; a no-op on CPU)."""


class WatchdogConfig(Strict):
    """Rank 0's watchdog over the other learner ranks (``megathunder.learner.liveness``; only with
    more than one rank). While a learner call is in flight it ends the run, in one line naming the
    rank, when a rank hangs: a process stopped or frozen fails no collective, so without it rank 0
    would wait for gloo's process-group timeout (30 minutes). The bounds must never be reached by
    a healthy but slow run: a false alarm stops a run that would have finished."""

    heartbeat_timeout_s: float = Field(30.0, ge=3.0, le=86400.0)
    """A rank whose heartbeat (a thread of its own, one beat per second) has not changed for this
    long while a call is in flight hung (SIGSTOP, a frozen machine). At least 3 beats; generous,
    because a thread of a process that holds Python's lock in a long C call, or one swapping, beats
    late."""
    call_timeout_s: float = Field(0.0, ge=0.0, le=604800.0)
    """A learner call in flight for longer than this names the ranks that have not finished it
    (wedged in their step while their heartbeat lives). 0: off (gloo's own timeout then ends such a
    wait). When set, it must exceed the slowest healthy call -- a checkpoint or export of the whole
    model on a slow file system included -- by a wide margin; at least 10 s."""

    @field_validator("call_timeout_s")
    @classmethod
    def _check_call_timeout(cls, value: float) -> float:
        if 0 < value < 10:
            raise ValueError(f"0 (off) or at least 10 s, not {value:g} (the slowest healthy call must stay well "
                             "under it)")
        return value


class MoEConfig(Strict):
    """How a mixture-of-experts student is trained (Megatron's MoE layers; the model's shape is
    ``learner.model``'s, read from config.json). Router losses default to off, so the RL gradient
    is exactly the policy loss's."""

    load_balancing_type: Literal["none", "aux_loss", "seq_aux_loss", "global_aux_loss"] = "none"
    """Megatron's ``moe_router_load_balancing_type``: none, or the auxiliary load-balancing loss
    over each micro-batch's tokens / each sequence / the global batch. Trained (``aux_loss_coeff``
    > 0) only as ``seq_aux_loss``: the one that is a sum of per-trajectory terms, so the ledger
    streams it exactly (``megathunder.learner.router_losses``)."""
    aux_loss_coeff: float = Field(0.0, ge=0)
    """Weight of the load-balancing loss (Megatron's ``moe_aux_loss_coeff``), each trajectory's
    weighted like its KL term (nu_i x loss tokens / Z)."""
    z_loss_coeff: float = Field(0.0, ge=0)
    """Weight of the router z-loss (Megatron's ``moe_z_loss_coeff``), a mean over each
    trajectory's positions, weighted as ``aux_loss_coeff``'s."""
    grouped_gemm: bool = False
    """Megatron's grouped GEMM experts (``moe_grouped_gemm``; CUDA only): TEGroupedMLP on the
    Transformer Engine spec, the legacy GroupedMLP (bf16, the ``grouped_gemm`` package) on the local
    one; both load, export and push through the per-expert HF names (``megathunder.learner.hf``).
    false runs SequentialMLP, one matmul per expert."""
    token_dispatcher: Literal["allgather", "alltoall"] = "allgather"
    """How tokens reach their experts (``moe_token_dispatcher_type``); alltoall needs CUDA streams."""
    routing_replay: bool = False
    """Routing replay ("R3"): the rollout engine records the experts it routed every token to
    (``rollout.engine.record_routing``, set by this) and the learner's routers use exactly those
    for the trajectory's forward and backward (Megatron's ``RouterReplay``), so the gradient is
    the one of the experts that produced the sample even where the two stacks' rounding would
    break a near-tie differently (``megathunder.learner.routing_replay``)."""

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.aux_loss_coeff > 0 and self.load_balancing_type == "none":
            raise ValueError("aux_loss_coeff: > 0 needs a load_balancing_type (seq_aux_loss)")
        if self.aux_loss_coeff > 0 and self.load_balancing_type in ("aux_loss", "global_aux_loss"):
            over = "each micro-batch's tokens" if self.load_balancing_type == "aux_loss" else "the global batch's tokens"
            raise ValueError(f"load_balancing_type: {self.load_balancing_type} balances {over} together, which is "
                             "no sum of per-trajectory terms: the streamed gradient could not equal the batch's "
                             "(it would depend on how trajectories are grouped into micro-batches); use "
                             "seq_aux_loss (each sequence's own balance)")
        return self

    @property
    def router_losses(self) -> bool:
        """Whether router losses are trained (a non-zero seq_aux_loss or z-loss)."""
        return (self.aux_loss_coeff > 0 and self.load_balancing_type == "seq_aux_loss") or self.z_loss_coeff > 0


class LearnerConfig(Strict):
    parallel: ParallelConfig = ParallelConfig()
    model: PolicyModelConfig = PolicyModelConfig()
    precision: PrecisionConfig = PrecisionConfig()
    activations: ActivationsConfig = ActivationsConfig()
    optimizer: LearnerOptimizerConfig = LearnerOptimizerConfig()
    reference: ReferenceModelConfig = ReferenceModelConfig()
    moe: MoEConfig = MoEConfig()
    watchdog: WatchdogConfig = WatchdogConfig()
    seed: int = 1234
    cpu_cores: list[int] | None = None
    """CPU cores the learner computes on (``[0, 1]``, ``3`` or ``"0-3,6"``; ``megathunder.cpu_cores``):
    each learner rank's compute thread is pinned to its share of them (the ranks of a node split the
    list in order) with torch's intra-op threads sized to it. With ``rollout.engine.cpu_cores`` on a
    machine where both run, the learner's work no longer takes compute from generation. null: the
    OS places it."""
    pack_tokens: int = Field(4096, ge=0)
    """The most tokens of one packed micro-batch: a schedule call over several trajectories (the
    batch-synchronous gradient, a closing group's summed backward, token logprobs, SFT) groups
    them, longest first, into micro-batches of rows x longest padded length <= pack_tokens, one
    [rows, length] forward each (``megathunder.learner.micro_batches.PackedRows``); a longer
    trajectory is a micro-batch alone. 0: one trajectory per micro-batch. Exact either way (the
    loss of a micro-batch is the sum of its trajectories'); it trades per-micro-batch overhead
    (one forward and backward's launches, a pipeline stage hand-off) for activation memory, which
    grows with the tokens of one micro-batch (the local spec's unfused attention also with rows x
    length^2 scores). Context parallelism: ignored (one trajectory per micro-batch)."""
    loss_logits_only: bool = True
    """Training passes compute the output layer (the LM head: logits, log-softmax, entropy) only at
    the targets the loss reads -- each trajectory's loss-mask positions -- not at its prompt, tool
    outputs or pads. Exact: no other position's logit enters a loss, and the hidden states below the
    head are computed as before; the selected rows' GEMM is the full one's rows, equal up to fp32
    rounding. It saves the head's FLOPs at those positions (a 49k vocabulary on a 135M model is 21%
    of the forward-backward, most positions being prompt) and the [tokens, vocab / TP] logits they
    would hold, which dominate activation memory at long contexts. Forward-only scoring (the probe,
    reference and old logprobs) computes every position. Context parallelism: ignored (off)."""
    share_prefixes: bool = True
    """Training passes and forward-only scoring (reference and old logprobs) forward a group's
    trajectories as one packed row, their common prefix (the prompt, and whatever else they share)
    once: [prefix | suffix_1 | ... | suffix_m], each suffix attending to the prefix and itself only,
    at its own positions (``megathunder.learner.shared_prefix``). Exact (each trajectory's logits are
    the same function of the weights; equal up to fp32 rounding); on GRPO groups of 8 with ~36-token
    prompts and 8 new tokens the pass forwards 100 positions a group instead of 352. Needs
    ``loss_logits_only``, ``pack_tokens`` > 0 (a row holds at most that many positions, and at most
    4096: its attention mask is W x W booleans) and our core attention (``precision.core_attention``
    sdpa, past_kv or auto on the local spec); off for MoE models and under context parallelism,
    where each trajectory is a row of its own."""

    @field_validator("cpu_cores", mode="before")
    @classmethod
    def _cores(cls, value: object) -> object:
        return cpu_cores.parse(value)

    @model_validator(mode="after")
    def _check(self) -> LearnerConfig:
        tp, pp, m = self.parallel.tensor_parallel, self.parallel.pipeline_parallel, self.model
        router_features = (  # both need each micro-batch's routers to run once, on the rows laid out as SP lays them
            (self.moe.routing_replay, "moe.routing_replay", "the replayed rows follow the sequence and SP layouts only",
             "replayed experts"),
            (self.moe.router_losses, "moe.aux_loss_coeff / z_loss_coeff",
             "each row's positions follow the sequence-parallel layout only", "router-loss weights"))
        for enabled, field, layout, held in router_features:
            if not enabled:
                continue
            if self.parallel.context_parallel > 1:
                raise ValueError(f"{field}: context_parallel > 1 is not supported ({layout}); use 1")
            act = self.activations
            if act.recompute == "full" or (act.recompute == "selective" and "mlp" in act.recompute_modules):
                raise ValueError(f"{field}: activations.recompute would run the routers again in the backward, "
                                 f"after the micro-batch's {held} are gone; recompute core_attn / layernorm only")
        if self.moe.grouped_gemm and self.precision.layer_spec == "local" and self.precision.params_dtype != "bfloat16":
            raise ValueError("moe.grouped_gemm: on the local spec Megatron builds the legacy GroupedMLP, whose forward "
                             "runs bf16 only (it asserts bf16); set precision.params_dtype=bfloat16, or "
                             "layer_spec=transformer_engine (TEGroupedMLP)")
        if m.hf_checkpoint is None:  # sizes known now; an HF checkpoint is checked when read
            check_parallel_divides_model(m, tp, pp, self.parallel.context_parallel, self.parallel.cp_comm_type)
            if m.is_moe:  # a dense learner.model may be a stand-in for run.init_model (checked by the root)
                check_experts_divide_model(m, self.parallel)
        spec, attention = self.precision.layer_spec, self.precision.attention
        if self.parallel.context_parallel > 1:
            if spec != "transformer_engine":
                raise ValueError(
                    f"parallel.context_parallel: {self.parallel.context_parallel} needs "
                    "precision.layer_spec=transformer_engine (context-parallel attention is Transformer "
                    "Engine's; the local spec has none)")
            if attention != "megatron":
                raise ValueError(f"parallel.context_parallel: not with precision.core_attention={attention} "
                                 "(context parallelism runs in Transformer Engine's attention)")
        if "share_prefixes" in self.model_fields_set and self.share_prefixes and (
                attention == "megatron" or not self.loss_logits_only or self.pack_tokens == 0):
            raise ValueError(f"share_prefixes: needs precision.core_attention sdpa or past_kv (not {attention}), "
                             f"loss_logits_only (is {self.loss_logits_only}) and pack_tokens > 0 "
                             f"(is {self.pack_tokens}); set it false")
        if self.activations.recompute != "none" and attention == "past_kv":
            raise ValueError("activations.recompute: not with precision.core_attention=past_kv (a recomputed "
                             "segment forward would no longer see its past keys/values)")
        return self


def check_parallel_divides_model(m: PolicyModelConfig, tp: int, pp: int, cp: int = 1,
                                 cp_comm_type: str = "p2p") -> None:
    """Raise ValueError naming the field when the layout cannot shard this model."""
    if m.num_attention_heads % tp:
        raise ValueError(
            f"parallel.tensor_parallel: {tp} does not divide "
            f"model.num_attention_heads={m.num_attention_heads}"
        )
    if m.num_query_groups % tp:
        raise ValueError(
            f"parallel.tensor_parallel: {tp} does not divide model.num_query_groups={m.num_query_groups}"
        )
    if m.vocab_size % tp:
        raise ValueError(f"parallel.tensor_parallel: {tp} does not divide model.vocab_size={m.vocab_size}")
    if m.ffn_hidden_size % tp:
        raise ValueError(
            f"parallel.tensor_parallel: {tp} does not divide model.ffn_hidden_size={m.ffn_hidden_size}"
        )
    if m.num_layers % pp:
        raise ValueError(f"parallel.pipeline_parallel: {pp} does not divide model.num_layers={m.num_layers}")
    if cp > 1 and cp_comm_type.startswith("a2a"):  # all-to-all over CP exchanges heads (TE)
        for name, count in (("num_attention_heads", m.num_attention_heads), ("num_query_groups", m.num_query_groups)):
            if count % (tp * cp):
                raise ValueError(f"parallel.context_parallel: tensor_parallel x context_parallel = {tp} x {cp} "
                                 f"does not divide model.{name}={count} (cp_comm_type={cp_comm_type})")


def check_experts_divide_model(m: PolicyModelConfig, parallel: ParallelConfig) -> None:
    """Raise ValueError naming the field when the expert layout cannot shard this model's experts
    (or is set for a dense model)."""
    ep, etp = parallel.expert_parallel, parallel.expert_tensor_parallel_size
    if m.num_experts is None:
        if ep > 1:
            raise ValueError(f"parallel.expert_parallel: {ep} for a dense model (model.num_experts is null)")
        return
    if m.num_experts % ep:
        raise ValueError(f"parallel.expert_parallel: {ep} does not divide model.num_experts={m.num_experts}")
    if m.expert_ffn_hidden_size % etp:
        raise ValueError(f"parallel.expert_tensor_parallel: {etp} does not divide "
                         f"model.moe_ffn_hidden_size={m.expert_ffn_hidden_size}")
    if parallel.tensor_parallel > 1 and not parallel.sequence_parallel:
        raise ValueError(f"parallel.sequence_parallel: a mixture of experts under tensor_parallel="
                         f"{parallel.tensor_parallel} needs sequence parallelism (Megatron's MoE layer refuses to "
                         "train without it)")
