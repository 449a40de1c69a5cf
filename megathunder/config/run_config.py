"""The run's sections (``run``, ``schedule``, ``batch``, ``sft``, ``eval``, ``exactness``) and the
``Config`` root, whose validators hold the rules that span sections (each names the field it
blames)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from pydantic import Field, ValidationInfo, field_validator, model_validator

from megathunder.config.base import Strict, default_tag
from megathunder.config.learner_config import LearnerConfig, LearnerOptimizerConfig, check_experts_divide_model
from megathunder.config.objective_config import (
    DistillObjective,
    GRPOObjective,
    LedgerConfig,
    ObjectiveConfig,
    OPDGRPOObjective,
    RLObjective,
)
from megathunder.config.rollout_config import (
    AgentLoopConfig,
    ContainerSandboxConfig,
    DatasetTaskConfig,
    GeneratedTaskConfig,
    LocalSandboxConfig,
    LocalTaskConfig,
    RolloutConfig,
    SandboxConfig,
    TaskConfig,
    VerifierConfig,
)

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
    probe_tokens: int = Field(16, ge=0)
    """Zero-staleness probe after each weight sync: the length of the continuation the engine samples
    once and then scores after every push in one prefill, as the learner does (0: off)."""
    probe_tolerance: float = Field(1e-3, gt=0)
    """The smallest tolerance of the probe: a push is stale when its largest per-token |logprob gap|
    exceeds max(probe_tolerance, probe_noise_margin * the noise floor) (``megathunder.trainer.probe``)."""
    probe_calibration_probes: int = Field(3, ge=1)
    """Continuations on the first pushed weights (the same on both sides), scored as a push's probe
    is, that measure the noise floor; each is also compared as sampled, at the run's temperature."""
    probe_noise_margin: float = Field(10.0, ge=1)
    """How many times the noise floor a gap may reach (measured: the largest later gap was 3.2x the
    floor over 300 probes with a bf16 engine, 2.6x with fp32: BENCHMARKS.md, "probe noise")."""
    probe_max_noise_floor: float = Field(1.0, gt=0)
    """A floor above this is not numerics: vLLM and the learner compute different models (a RoPE,
    vocabulary or layout mismatch); the run stops at its first push."""
    probe_overlap: bool = True
    """sync and thunder: after a push vLLM's part of the probe (one prefill) runs at once, alone, and
    the learner scores it while the next batch generates; the probe is checked before that batch's
    gradient is closed, so a failed probe stops the run before anything sampled after it is trained
    on. The step's records are written then. Not at the run's last step, nor before an evaluation,
    a checkpoint or a chaos fault of the step: those run after the whole probe, as without it."""
    paired_sync: bool = False
    """thunder only: the even optimizer steps take sync's path (the whole batch, then its gradient)
    and the odd ones thunder's; each step's metrics row names its path (``schedule``). Both give
    the same update, so the run trains as either would; only the timing differs, and here it is
    measured step against step in one run, where a shared machine's drift moves two separate runs
    apart by more than the difference (``megathunder bench schedules --paired``)."""

    @model_validator(mode="after")
    def _check(self) -> ScheduleConfig:
        if self.paired_sync and self.mode != "thunder":
            raise ValueError(f"paired_sync: alternates thunder's steps with sync's; needs mode thunder (not {self.mode})")
        return self


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


EPISODE_FAULTS = ("crash_verifier", "hang_verifier", "hang_sandbox", "oom_tool")
"""Faults of chosen trajectories' episodes (``trajectories`` of step ``step``)."""
SERVER_FAULTS = ("kill_server", "hang_server")
"""Faults of the rollout engine, when ``after_trajectories`` of step ``step``'s trajectories have finished."""
IN_PROCESS_FAULTS = ("kill_engine", "hang_engine")
"""Faults of the in-process engine, fired as the server faults are; survived by a restart in place."""
ENGINE_FAULTS = (*SERVER_FAULTS, *IN_PROCESS_FAULTS)
LEARNER_FAULTS = ("kill_learner", "hang_learner")
"""Faults of a learner rank > 0, fired as the server faults are (``after_trajectories`` of ``step``)."""


class ChaosFault(Strict):
    """One fault injected into a run (``megathunder.trainer.chaos``)."""

    kind: Literal["fill_disk", "sigusr1", "sigint", "kill_server", "hang_server", "kill_engine", "hang_engine",
                  "crash_verifier", "hang_verifier", "hang_sandbox", "oom_tool", "corrupt_journal", "kill_learner",
                  "hang_learner", "stale_push"]
    """fill_disk: fill the run directory's file system (the next write fails); sigusr1 / sigint: the
    signal to this process (stop after the step, checkpoint, exit 75); kill_server / hang_server:
    SIGKILL / SIGSTOP rollout server ``server``'s process group (deployment=server, launched here);
    kill_engine / hang_engine: SIGKILL / SIGSTOP the in-process engine's engine core and its workers
    (deployment=in_process; restarted in place, ``rollout.engine.max_restarts``: the stopped one once
    its requests made no progress for ``rollout.engine.stall_timeout_s``);
    crash_verifier / hang_verifier: the verifier of ``trajectories`` raises / sleeps past
    ``verifier.timeout_s`` (-> ``verifier.on_failure``); hang_sandbox / oom_tool: a ``bash`` tool call
    in the episode's sandbox (a local one built for it when the task has none) that sleeps past
    ``sandbox.wall_time_s`` / allocates twice ``sandbox.memory_mb``, run after the episode's turns
    (its result must be an error observation; the episode goes on); corrupt_journal: the journal's
    last record (the step's) is torn after the step, and the run stops as a crash would (exit 130,
    no checkpoint of that step); kill_learner / hang_learner: learner rank ``rank`` SIGKILLs /
    SIGSTOPs itself as it receives the learner's next message (the run stops: rank 0 names the
    dead rank, exit 1, or its watchdog the hung one, exit 86, within
    ``learner.watchdog.heartbeat_timeout_s``; the same command resumes); stale_push: the push after
    step ``step`` loads nothing, but the in-process engine stamps the new version as if it had (a
    transfer that silently failed): the probe must stop the run (exit 1) before the next batch's
    gradient is applied."""
    step: int = Field(0, ge=0)
    """The optimizer step during (server, learner and episode faults) or after (the others) which it happens."""
    after_trajectories: int = Field(0, ge=0)
    """Engine faults (kill_server, hang_server, kill_engine, hang_engine) and learner faults: when this many of the
    step's trajectories have finished."""
    during: Literal["generation", "weight_update"] = "generation"
    """kill_engine / hang_engine: ``generation`` -- while requests are in flight outside a weight
    update (survived in place); ``weight_update`` -- as the weight update after that moment begins
    (the step's push: not survived in place; the update fails, the run stops in one line, exit 1,
    and the same command resumes from the last checkpoint)."""
    server: int = Field(0, ge=0)
    rank: int = Field(1, ge=1)
    """Learner faults: the learner rank that dies or hangs (not 0: rank 0 is the controller, whose
    loss ends the run on every rank anyway); below the learner's world size (checked at start)."""
    trajectories: list[int] = Field(default_factory=lambda: [0])
    """Episode faults: the trajectory ids (in the step's batch: group g's sample k is g x
    samples_per_prompt + k) whose episodes get the fault."""

    @field_validator("during")
    @classmethod
    def _check_during(cls, value: str, info: ValidationInfo) -> str:
        kind = info.data.get("kind")
        if value != "generation" and kind not in IN_PROCESS_FAULTS:
            raise ValueError(f"{value} is for {' and '.join(IN_PROCESS_FAULTS)} (not {kind})")
        return value

    @field_validator("trajectories")
    @classmethod
    def _check_trajectories(cls, value: list[int]) -> list[int]:
        if not value or any(t < 0 for t in value):
            raise ValueError(f"{value}: one or more trajectory ids, each >= 0")
        return value


class ChaosConfig(Strict):
    """Faults to inject, for soak tests and for trying recovery (RELIABILITY.md); none by default."""

    faults: list[ChaosFault] = []


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


class Config(Strict):
    run: RunConfig = RunConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    batch: BatchConfig = BatchConfig()
    objective: ObjectiveConfig = GRPOObjective()
    ledger: LedgerConfig = LedgerConfig()
    rollout: RolloutConfig = RolloutConfig()
    learner: LearnerConfig = LearnerConfig()
    agent: AgentLoopConfig = AgentLoopConfig()
    sandbox: SandboxConfig = LocalSandboxConfig()
    verifier: VerifierConfig = VerifierConfig()
    task: TaskConfig = GeneratedTaskConfig()
    eval: EvalConfig = EvalConfig()
    sft: SftConfig = SftConfig()
    exactness: ExactnessConfig = ExactnessConfig()
    chaos: ChaosConfig = ChaosConfig()

    @field_validator("objective", mode="before")
    @classmethod
    def _default_objective(cls, value: object) -> object:
        return default_tag(value, "kind", "grpo")

    @field_validator("sandbox", mode="before")
    @classmethod
    def _default_sandbox(cls, value: object) -> object:
        return default_tag(value, "backend", "local")

    @field_validator("task", mode="before")
    @classmethod
    def _default_task(cls, value: object) -> object:
        return default_tag(value, "name", "arithmetic")

    @model_validator(mode="after")
    def _check_rollout_side(self) -> Config:
        # Terminal-Bench tasks whose environment is files only also run on the local sandbox (it
        # refuses the others by name); a SWE-bench / SWE-smith repository exists only in its image.
        if (isinstance(self.task, DatasetTaskConfig) and self.task.name != "terminal_bench"
                and isinstance(self.sandbox, LocalSandboxConfig)):
            raise ValueError(
                f"sandbox.backend: task {self.task.name} runs in each instance's container image; "
                "use docker, podman, apptainer or enroot"
            )
        sb = self.sandbox
        if isinstance(self.task, LocalTaskConfig) and isinstance(sb, ContainerSandboxConfig) and not sb.image:
            raise ValueError(
                f"sandbox.image: task {self.task.name} makes its instances here, with no image of "
                f"their own; backend {sb.backend} needs one (e.g. the tag `megathunder sandbox "
                "build-base` prints), or use backend local"
            )
        if isinstance(sb, LocalSandboxConfig) and sb.num_uids < self.agent.max_concurrent_episodes:
            raise ValueError(
                f"sandbox.num_uids: {sb.num_uids} is fewer than agent.max_concurrent_episodes="
                f"{self.agent.max_concurrent_episodes} (each open local sandbox needs its own uid)"
            )
        return self

    @model_validator(mode="after")
    def _check_cpu_cores(self) -> Config:
        learner, rollout = self.learner.cpu_cores, self.rollout.engine.cpu_cores
        shared = sorted(set(learner or ()) & set(rollout or ()))
        if shared:
            raise ValueError(f"learner.cpu_cores: cores {shared} are also rollout.engine.cpu_cores; give each "
                             "side its own (or leave one null)")
        return self

    @model_validator(mode="after")
    def _derive_ledger(self) -> Config:
        """A group can be dropped at its last reward only if nothing of it reached the update. An
        infrastructure failure of a benchmark task drops its group unless configured otherwise."""
        if self.verifier.on_infra_failure is None and isinstance(self.task, DatasetTaskConfig):
            self.verifier = self.verifier.model_copy(update={"on_infra_failure": "drop_group"})
        drops = "drop_group" in (self.verifier.on_failure, self.verifier.infra_policy())
        if drops and not self.ledger.hold_groups_until_close:
            if "hold_groups_until_close" in self.ledger.model_fields_set:
                raise ValueError("ledger.hold_groups_until_close: must be true with verifier.on_failure (or "
                                 "on_infra_failure) drop_group (a failed trajectory's group must still be droppable)")
            self.ledger = self.ledger.model_copy(update={"hold_groups_until_close": True})
        return self

    @model_validator(mode="after")
    def _check_chaos(self) -> Config:
        engine = self.rollout.engine
        for i, fault in enumerate(self.chaos.faults):
            if fault.kind in SERVER_FAULTS:
                if engine.deployment != "server" or engine.server_urls:
                    raise ValueError(f"chaos.faults.{i}.kind: {fault.kind} needs rollout.engine.deployment=server "
                                     "with servers launched by this run (not server_urls)")
                if fault.server >= engine.num_servers:
                    raise ValueError(f"chaos.faults.{i}.server: {fault.server} >= rollout.engine.num_servers="
                                     f"{engine.num_servers}")
            if fault.kind in IN_PROCESS_FAULTS:
                if engine.deployment != "in_process":
                    raise ValueError(f"chaos.faults.{i}.kind: {fault.kind} needs rollout.engine.deployment=in_process "
                                     f"({fault.kind.replace('engine', 'server')} is a server's)")
                if self.schedule.mode not in ("sync", "thunder") or engine.max_restarts == 0:
                    raise ValueError(f"chaos.faults.{i}.kind: {fault.kind} is survived in place under schedule.mode "
                                     f"sync or thunder with rollout.engine.max_restarts >= 1 (now "
                                     f"{self.schedule.mode}, {engine.max_restarts})")
            if fault.kind == "stale_push":
                if engine.deployment != "in_process" or self.schedule.probe_tokens == 0:
                    raise ValueError(f"chaos.faults.{i}.kind: stale_push needs rollout.engine.deployment=in_process "
                                     "and the probe (schedule.probe_tokens > 0), which must catch it")
            dp = self.learner.parallel.data_parallel  # the world size is known here only when it is set
            if fault.kind in LEARNER_FAULTS and dp is not None:
                par = self.learner.parallel
                world = par.tensor_parallel * par.pipeline_parallel * par.context_parallel * dp
                if fault.rank >= world:
                    raise ValueError(f"chaos.faults.{i}.rank: {fault.rank} >= the learner's world size {world} "
                                     "(learner.parallel: tensor x pipeline x context x data)")
            if fault.kind in EPISODE_FAULTS:
                size = self.batch.num_prompts_per_batch * self.batch.samples_per_prompt
                if max(fault.trajectories) >= size:
                    raise ValueError(f"chaos.faults.{i}.trajectories: {max(fault.trajectories)} >= the batch's "
                                     f"{size} trajectories (batch.num_prompts_per_batch x samples_per_prompt)")
            if fault.kind == "corrupt_journal":
                every = self.run.checkpoint_every
                if not every or every > fault.step:
                    raise ValueError(f"chaos.faults.{i}.step: corrupt_journal at step {fault.step} needs a "
                                     f"checkpoint before it to resume from (run.checkpoint_every={every}: "
                                     "1..step)")
            if fault.step >= self.run.num_steps:
                raise ValueError(f"chaos.faults.{i}.step: {fault.step} >= run.num_steps={self.run.num_steps}")
        return self

    @model_validator(mode="after")
    def _derive_routing(self) -> Config:
        """Routing replay: the engine records what the learner replays."""
        if not self.learner.moe.routing_replay:
            return self
        if self.schedule.mode not in ("sync", "thunder"):
            raise ValueError(f"learner.moe.routing_replay: needs schedule.mode sync or thunder (under "
                             f"{self.schedule.mode} a weight push between an episode's turns would clear the "
                             "engine's record of its earlier turns)")
        if isinstance(self.objective, DistillObjective):
            raise ValueError(f"learner.moe.routing_replay: objective.kind={self.objective.kind} forwards turns "
                             "outside the replayed schedule; use grpo")
        if not self.rollout.engine.record_routing:  # (assignment validates again: set once)
            engine = self.rollout.engine.model_copy(update={"record_routing": True})
            self.rollout = self.rollout.model_copy(update={"engine": engine})
        return self

    @model_validator(mode="after")
    def _check_refill(self) -> Config:
        if self.batch.max_refill_groups == 0:
            return self
        obj = self.objective
        drops = isinstance(obj, GRPOObjective) and (obj.dapo_dynamic_sampling or self.verifier.on_failure == "drop_group")
        if not drops:
            raise ValueError(f"batch.max_refill_groups: {self.batch.max_refill_groups} refills dropped groups, but "
                             "this run drops none (objective.kind grpo with objective.dapo_dynamic_sampling or "
                             "verifier.on_failure: drop_group); use 0")
        return self

    @model_validator(mode="after")
    def _check_distillation(self) -> Config:
        obj = self.objective
        if not isinstance(obj, DistillObjective):
            return self
        if self.schedule.mode not in ("sync", "thunder"):
            raise ValueError(
                f"schedule.mode: objective.kind={obj.kind} trains on the student's own samples (sync or "
                f"thunder); {self.schedule.mode} would train on stale samples"
            )
        if self.learner.parallel.pipeline_parallel > 1:  # a turn's forward is a plain model call
            raise ValueError(f"learner.parallel.pipeline_parallel: objective.kind={obj.kind} runs each turn's "
                             "forward as one model call, not a pipeline schedule; use 1")
        if self.learner.parallel.context_parallel > 1:
            raise ValueError(f"learner.parallel.context_parallel: objective.kind={obj.kind} forwards each turn "
                             "as one model call on the whole segment; use 1")
        if self.learner.parallel.sequence_parallel:
            raise ValueError(f"learner.parallel.sequence_parallel: objective.kind={obj.kind} forwards each turn "
                             "segment as one model call of its own length, which sequence parallelism would split "
                             "over the TP ranks; use false")
        if obj.strategy != "recompute" and self.learner.precision.core_attention != "past_kv":
            raise ValueError(f"objective.strategy: {obj.strategy} needs learner.precision.core_attention=past_kv")
        if isinstance(obj, OPDGRPOObjective) and self.verifier.on_failure == "drop_group":
            raise ValueError("verifier.on_failure: drop_group cannot be combined with opd_grpo (a dropped "
                             "group's KL terms are already streamed); use zero_reward")
        return self

    @model_validator(mode="after")
    def _check_per_turn_scores(self) -> Config:
        """Per-turn score gradients: what ``megathunder.streaming.grpo_turns`` can stream exactly."""
        strategy = self.ledger.per_turn_scores
        if strategy == "off" or self.schedule.mode != "thunder":  # only thunder streams a batch's gradient
            return self
        obj, par = self.objective, self.learner.parallel
        field = f"ledger.per_turn_scores: {strategy}"
        if obj.kind != "grpo":
            raise ValueError(f"{field} streams GRPO's score term; objective.kind={obj.kind} (opd_grpo's turns "
                             "already stream its KL term; use off)")
        assert isinstance(obj, RLObjective)
        if self.ledger.max_pending == 0:
            raise ValueError(f"{field} accumulates each trajectory's h_i in a pending buffer; "
                             "ledger.max_pending is 0 (set a number, or null for the budget's)")
        if obj.tis == "sequence":
            raise ValueError(f"{field}: objective.tis sequence weights every token by the whole trajectory's "
                             "ratio, unknown before it ends; use token or none")
        if obj.loss_agg == "seq_mean_token_mean":
            raise ValueError(f"{field}: objective.loss_agg seq_mean_token_mean weights a trajectory by 1 / its "
                             "length, unknown before it ends; use token_mean, seq_mean_token_sum or "
                             "seq_mean_token_sum_norm")
        for name, value in (("pipeline_parallel", par.pipeline_parallel), ("context_parallel", par.context_parallel)):
            if value > 1:
                raise ValueError(f"learner.parallel.{name}: {field} forwards each turn as one model call; use 1")
        if par.sequence_parallel:
            raise ValueError(f"learner.parallel.sequence_parallel: {field} forwards each turn segment as one "
                             "model call of its own length; use false")
        if strategy != "recompute" and self.learner.precision.core_attention != "past_kv":
            raise ValueError(f"{field} needs learner.precision.core_attention=past_kv")
        if self.learner.model.is_moe or (self.run.init_model == "tiny" and self.run.tiny_model.num_experts):
            raise ValueError(f"{field}: a MoE model's router losses and routing replay do not run in a turn's "
                             "forward; use off")
        return self

    @model_validator(mode="after")
    def _check_experts(self) -> Config:
        """The expert layout against the model the run builds, where it is known before any file is
        read: the tiny model (``run.init_model: tiny``) or ``learner.model``'s own sizes."""
        m = self.learner.model
        if m.hf_checkpoint is not None or m.is_moe:
            return self  # read from config.json when built / checked by the learner section
        if self.run.init_model != "tiny":
            return self  # a checkpoint directory: checked when read
        t = self.run.tiny_model
        tiny = m if not t.num_experts else m.model_copy(update=dict(
            family="qwen3_moe", num_experts=t.num_experts, moe_router_topk=t.num_experts_per_tok,
            moe_ffn_hidden_size=t.moe_intermediate_size))
        try:
            check_experts_divide_model(tiny, self.learner.parallel)
        except ValueError as err:
            raise ValueError(f"learner.{err}".replace("model.num_experts is null", "run.tiny_model.num_experts is 0")
                             .replace("model.num_experts", "run.tiny_model.num_experts")
                             .replace("model.moe_ffn_hidden_size", "run.tiny_model.moe_intermediate_size")) from None
        return self

    @model_validator(mode="after")
    def _check_on_policy_sampling(self) -> Config:
        """sync and thunder train the distribution sampled: the learner reproduces the temperature,
        not a truncation of the vocabulary."""
        if self.schedule.mode in ("sync", "thunder"):
            r = self.rollout
            if r.top_p < 1:
                raise ValueError(f"rollout.top_p: {r.top_p} truncates the sampled distribution, whose logprobs the "
                                 f"learner does not reproduce; schedule.mode={self.schedule.mode} trains exactly "
                                 "on-policy: use 1.0 (or async / fully_async with objective.tis)")
            if r.top_k != -1:
                raise ValueError(f"rollout.top_k: {r.top_k} truncates the sampled distribution, whose logprobs the "
                                 f"learner does not reproduce; schedule.mode={self.schedule.mode} trains exactly "
                                 "on-policy: use -1 (or async / fully_async with objective.tis)")
        return self

    @model_validator(mode="after")
    def _check_streamable(self) -> Config:
        """Thunder streams one optimizer step per batch; anything else is not exact."""
        obj = self.objective
        if self.schedule.mode != "thunder" or not isinstance(obj, RLObjective):
            return self
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
        if obj.ppo_old_logprobs != "learner":
            raise ValueError(
                "objective.ppo_old_logprobs: thunder is exactly on-policy (the ratio is 1 by "
                f"construction); {obj.ppo_old_logprobs} needs schedule.mode async or fully_async"
            )
        return self

    @model_validator(mode="after")
    def _check_off_policy_correction(self) -> Config:
        """async / fully_async sample with older policies: the gradient needs an importance correction."""
        obj = self.objective
        if self.schedule.mode not in ("async", "fully_async") or not isinstance(obj, RLObjective):
            return self
        if obj.tis == "none" and obj.ppo_old_logprobs == "learner" and not obj.allow_uncorrected_off_policy:
            raise ValueError(
                f"objective.tis: schedule.mode={self.schedule.mode} trains on samples of older policies; "
                "correct for it with objective.tis (token or sequence) or objective.ppo_old_logprobs=rollout, "
                "or set objective.allow_uncorrected_off_policy=true"
            )
        return self


def check_paths(cfg: Config) -> None:
    """The files a run reads exist: the model, the teacher, the task file (a one-line
    ``ValueError`` naming the field). For commands that use them; ``megathunder config`` does not
    check, so a cluster config validates anywhere."""
    model = cfg.learner.model.hf_checkpoint
    if model is None and cfg.run.init_model != "tiny":
        model, field = cfg.run.init_model, "run.init_model"
    else:
        field = "learner.model.hf_checkpoint"
    if model is not None:
        _check_model_dir(field, Path(model))
    obj = cfg.objective
    if isinstance(obj, DistillObjective) and obj.teacher.hf_checkpoint is not None:
        _check_model_dir("objective.teacher.hf_checkpoint", Path(obj.teacher.hf_checkpoint))
    if isinstance(cfg.task, DatasetTaskConfig):
        path = Path(cfg.task.path)
        if cfg.task.name == "terminal_bench":  # a directory of task directories
            if not path.is_dir():
                raise ValueError(f"task.path: {path}: no such directory (Terminal-Bench / Harbor tasks)")
        elif not path.is_file():
            raise ValueError(f"task.path: {path}: no such file")
        try:
            path.open("rb").close()
        except OSError as err:
            raise ValueError(f"task.path: {path}: cannot be read ({err.strerror})") from None


def _check_model_dir(field: str, path: Path) -> None:
    if not path.is_dir():
        raise ValueError(f"{field}: {path}: no such directory (a Hugging Face model directory)")
    if not (path / "config.json").is_file():
        raise ValueError(f"{field}: {path} has no config.json (a Hugging Face model directory)")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{field}: {path} has no *.safetensors weights")
