"""The run's own sections: ``run``, ``schedule``, ``probe``, ``batch``, ``sft``, ``eval``,
``exactness`` (the root ``Config`` that holds every section: ``megathunder.config.root``)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, model_validator

from megathunder.config.base import Strict
from megathunder.config.learner_config import LearnerOptimizerConfig

ScheduleMode = Literal["sync", "async", "fully_async", "thunder"]
"""The four schedules (``megathunder.trainer.schedules``); every other list of them is
``get_args(ScheduleMode)``."""
SCHEDULE_MODES: tuple[str, ...] = get_args(ScheduleMode)


class BatchConfig(Strict):
    num_prompts_per_batch: int = Field(8, ge=1)
    """Groups (prompts) a step trains on: with ``max_refill_groups`` the number of kept groups."""
    samples_per_prompt: int = Field(4, ge=1)
    max_refill_groups: int = Field(0, ge=0)
    """DAPO's dynamic sampling, refilled: each group the step drops (all rewards equal under
    ``objective.dapo_dynamic_sampling``, or a failed trajectory under ``verifier.on_failure:
    drop_group``) is replaced by a new group on the next training prompt, up to this many per step,
    so the step trains on ``num_prompts_per_batch`` kept groups unless the budget runs out (verl's
    ``max_num_gen_batches``). The step's groups are then the first ``num_prompts_per_batch`` kept ones
    of its prompt sequence, whatever order they finish in; under thunder a replacement streams like
    the others (zero staleness). 0: dropped groups are not replaced, the step trains on fewer."""


class ScheduleConfig(Strict):
    """How rollout and training overlap (``megathunder.trainer.schedules``).

    sync: the learner waits for the whole batch. thunder: streamed gradients, same update as sync.
    async: batch k+1 is sampled while the learner trains on batch k (one step stale).
    fully_async: episodes run continuously while weights change under them (bounded staleness).
    """

    mode: ScheduleMode = "thunder"
    max_staleness: int = Field(2, ge=1)
    """fully_async: a group whose oldest turn was sampled more than this many optimizer steps
    before the step that would train on it is dropped (and logged)."""
    @property
    def on_policy(self) -> bool:
        """sync and thunder: every batch is sampled by the weights it trains (policy lag 0)."""
        return self.mode in ("sync", "thunder")


class ProbeConfig(Strict):
    """The zero-staleness probe after every weight push (``megathunder.trainer.probe``): vLLM must
    sample from exactly the weights being trained."""

    tokens: int = Field(16, ge=0)
    """Zero-staleness probe after each weight sync: the length of the continuation the engine samples
    once and then scores after every push in one prefill, as the learner does (0: off)."""
    tolerance: float = Field(1e-3, gt=0)
    """The smallest tolerance of the probe: a push is stale when its largest per-token |logprob gap|
    exceeds max(probe.tolerance, probe.noise_margin * the noise floor) (``megathunder.trainer.probe``)."""
    calibration_probes: int = Field(3, ge=1)
    """Continuations on the first pushed weights (the same on both sides), scored as a push's probe
    is, that measure the noise floor; each is also compared as sampled, at the run's temperature."""
    noise_margin: float = Field(10.0, ge=1)
    """How many times the noise floor a gap may reach (measured: the largest later gap was 3.2x the
    floor over 300 probes with a bf16 engine, 2.6x with fp32: BENCHMARKS.md, `megathunder bench probe`)."""
    max_noise_floor: float = Field(1.0, gt=0)
    """A floor above this is not numerics: vLLM and the learner compute different models (a RoPE,
    vocabulary or layout mismatch); the run stops at its first push."""
    overlap: bool = True
    """sync and thunder: after a push vLLM's part of the probe (one prefill) runs at once, alone, and
    the learner scores it while the next batch generates; the probe is checked before that batch's
    gradient is closed, so a failed probe stops the run before anything sampled after it is trained
    on. The step's records are written then. Not at the run's last step, nor before an evaluation,
    a checkpoint or a chaos fault of the step: those run after the whole probe, as without it."""


class SftConfig(Strict):
    """Supervised warm start on the task's reference answers before RL (0 steps: none)."""

    num_steps: int = Field(0, ge=0)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0)

    def optimizer(self, base: LearnerOptimizerConfig) -> LearnerOptimizerConfig:
        """The warm start's optimizer: Adam (whatever ``base``, the RL optimizer, is) with this
        section's learning rate, a 10% warmup and a cosine decay to lr / 10 over ``num_steps``."""
        return base.model_copy(update={
            "name": "adam", "lr": self.lr, "min_lr": self.lr / 10, "lr_warmup_steps": max(1, self.num_steps // 10),
            "lr_decay_steps": self.num_steps, "lr_decay_style": "cosine",
        })  # fmt: skip


class EvalConfig(Strict):
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


class TinyModelConfig(Strict):
    """Sizes of the locally built tiny Qwen2, or Qwen3-MoE with ``num_experts`` > 0
    (``run.init_model: tiny``; the tokenizer is always the same). vLLM's CPU attention needs
    hidden_size / num_heads = 32."""

    hidden_size: int = Field(128, ge=32)
    intermediate_size: int = Field(256, ge=1)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    num_experts: int = Field(0, ge=0)
    """0: a dense Qwen2; > 1: a Qwen3-MoE with this many routed experts in every layer."""
    num_experts_per_tok: int = Field(2, ge=1)
    """MoE: experts per token (top-k)."""
    moe_intermediate_size: int = Field(64, ge=1)
    """MoE: each expert's SwiGLU width."""

    @model_validator(mode="after")
    def _check(self) -> TinyModelConfig:
        if self.num_experts == 1 or (self.num_experts and self.num_experts_per_tok > self.num_experts):
            raise ValueError(f"num_experts: {self.num_experts} with num_experts_per_tok={self.num_experts_per_tok} "
                             "(0 for a dense model, else at least 2 and at least the top-k)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size: {self.hidden_size} is not divisible by num_heads={self.num_heads}")
        return self


class RunConfig(Strict):
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


class DecoderConfig(Strict):
    """A small decoder built in-process (the learner's own model is configured with the learner)."""

    vocab_size: int = Field(64, ge=2)
    hidden_size: int = Field(32, ge=1)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    max_seq_len: int = Field(256, ge=2)
    dtype: Literal["float32", "float64"] = "float32"

    @model_validator(mode="after")
    def _check(self) -> DecoderConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size: {self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        return self


class DecoderOptimizerConfig(Strict):
    """The exactness run's torch optimizer."""

    name: Literal["sgd", "adamw"] = "adamw"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    max_grad_norm: float | None = Field(1.0, gt=0)


class ExactnessConfig(Strict):
    """``megathunder exactness``: the small in-process decoder it samples from, and its optimizer
    (the learner's own model and optimizer are ``learner.model`` / ``learner.optimizer``)."""

    model: DecoderConfig = DecoderConfig()
    optimizer: DecoderOptimizerConfig = DecoderOptimizerConfig()
