"""The rules that span a run's config sections: one named function each, grouped by feature.

``Config`` runs ``RULES`` in order once every section has validated (``run_config.Config._rules``).
A rule raises ``ValueError`` whose message starts with the dotted field it blames (the loader prints
it under that path), or sets a field the others imply (a ``derive`` rule: routing replay turns the
engine's recording on). Each section's own checks stay in its class; only what reads two sections
or more is here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from megathunder.config.chaos_config import (
    EPISODE_FAULTS,
    IN_PROCESS_FAULTS,
    LEARNER_FAULTS,
    SERVER_FAULTS,
    ChaosConfig,
)
from megathunder.config.learner_config import LearnerConfig, check_experts_divide_model
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
    RemoteSandboxConfig,
    RolloutConfig,
    SandboxConfig,
    TaskConfig,
    VerifierConfig,
    sandbox_runtime,
)
from megathunder.config.run_config import BatchConfig, ProbeConfig, RunConfig, ScheduleConfig

DEFAULT_VERIFIER_CONCURRENCY = 4




class Sections(Protocol):
    """The config as the rules read it (the root ``Config``, by its sections)."""

    run: RunConfig
    schedule: ScheduleConfig
    probe: ProbeConfig
    batch: BatchConfig
    objective: ObjectiveConfig
    ledger: LedgerConfig
    rollout: RolloutConfig
    learner: LearnerConfig
    agent: AgentLoopConfig
    sandbox: SandboxConfig
    verifier: VerifierConfig
    task: TaskConfig
    chaos: ChaosConfig


# ---------------------------------------------------------------------- where episodes run


def tasks_run_where_their_files_are(cfg: Sections) -> None:
    """Terminal-Bench tasks whose environment is files only also run on the local sandbox (it refuses
    the others by name); a SWE-bench / SWE-smith repository exists only in its instance image; a
    local task on a container backend needs an image; each open local sandbox needs its own uid.
    Sandbox servers (``backend: remote``) are held to the same rules for the backend they run."""
    remote = isinstance(cfg.sandbox, RemoteSandboxConfig)
    sb = sandbox_runtime(cfg.sandbox)
    at = "sandbox.runtime.backend" if remote else "sandbox.backend"
    if (isinstance(cfg.task, DatasetTaskConfig) and cfg.task.name != "terminal_bench"
            and isinstance(sb, LocalSandboxConfig)):
        raise ValueError(
            f"{at}: task {cfg.task.name} runs in each instance's container image; "
            "use docker, podman, apptainer or enroot"
        )
    if isinstance(cfg.task, LocalTaskConfig) and isinstance(sb, ContainerSandboxConfig) and not sb.image:
        raise ValueError(
            f"{at.replace('backend', 'image')}: task {cfg.task.name} makes its instances here, with no image of "
            f"their own; backend {sb.backend} needs one (e.g. the tag `megathunder sandbox "
            "build-base` prints), or use backend local"
        )
    if not remote and isinstance(sb, LocalSandboxConfig) and sb.num_uids < cfg.agent.max_concurrent_episodes:
        raise ValueError(
            f"sandbox.num_uids: {sb.num_uids} is fewer than agent.max_concurrent_episodes="
            f"{cfg.agent.max_concurrent_episodes} (each open local sandbox needs its own uid)"
        )


def verifiers_run_where_the_sandboxes_are(cfg: Sections) -> None:
    """``verifier.max_concurrent`` null (derive): 4 verifiers at once on the controller, or with
    sandbox servers as many as the servers hold sandboxes (each test run runs in its episode's own
    sandbox, on its server, which the servers bound), at most one per concurrent episode."""
    if cfg.verifier.max_concurrent is not None:
        return
    n = DEFAULT_VERIFIER_CONCURRENCY
    if isinstance(cfg.sandbox, RemoteSandboxConfig):
        episodes = cfg.agent.max_concurrent_episodes
        n = min(cfg.sandbox.capacity or episodes, episodes)
    cfg.verifier = cfg.verifier.model_copy(update={"max_concurrent": n})


def cores_are_disjoint(cfg: Sections) -> None:
    """The learner's and the rollout's cores are their own."""
    learner, rollout = cfg.learner.cpu_cores, cfg.rollout.engine.cpu_cores
    shared = sorted(set(learner or ()) & set(rollout or ()))
    if shared:
        raise ValueError(f"learner.cpu_cores: cores {shared} are also rollout.engine.cpu_cores; give each "
                         "side its own (or leave one null)")


# ---------------------------------------------------------------------- failures


def failed_groups_stay_droppable(cfg: Sections) -> None:
    """A group can be dropped at its last reward only if nothing of it reached the update. An
    infrastructure failure of a benchmark task drops its group unless configured otherwise."""
    if cfg.verifier.on_infra_failure is None and isinstance(cfg.task, DatasetTaskConfig):
        cfg.verifier = cfg.verifier.model_copy(update={"on_infra_failure": "drop_group"})
    drops = "drop_group" in (cfg.verifier.on_failure, cfg.verifier.infra_policy())
    if drops and not cfg.ledger.hold_groups_until_close:
        if "hold_groups_until_close" in cfg.ledger.model_fields_set:
            raise ValueError("ledger.hold_groups_until_close: must be true with verifier.on_failure (or "
                             "on_infra_failure) drop_group (a failed trajectory's group must still be droppable)")
        cfg.ledger = cfg.ledger.model_copy(update={"hold_groups_until_close": True})


def refill_needs_dropped_groups(cfg: Sections) -> None:
    """DAPO's refill replaces dropped groups: the run must drop some."""
    if cfg.batch.max_refill_groups == 0:
        return
    obj = cfg.objective
    drops = isinstance(obj, GRPOObjective) and (obj.dapo_dynamic_sampling or cfg.verifier.on_failure == "drop_group")
    if not drops:
        raise ValueError(f"batch.max_refill_groups: {cfg.batch.max_refill_groups} refills dropped groups, but "
                         "this run drops none (objective.kind grpo with objective.dapo_dynamic_sampling or "
                         "verifier.on_failure: drop_group); use 0")


# ---------------------------------------------------------------------- chaos


def faults_fit_the_run(cfg: Sections) -> None:
    """Each fault names parts this run has: a rollout server (launched here or attached), the
    in-process engine under an on-policy schedule, the probe that must catch a stale push, a bash
    tool, trajectories of the batch, a checkpoint to resume from, a step of the run."""
    engine = cfg.rollout.engine
    for i, fault in enumerate(cfg.chaos.faults):
        if fault.kind in SERVER_FAULTS:
            if engine.deployment != "server":
                raise ValueError(f"chaos.faults.{i}.kind: {fault.kind} needs rollout.engine.deployment=server")
            servers = len(engine.server_urls) or engine.num_servers  # attached ones, else launched ones
            if fault.server >= servers:
                raise ValueError(f"chaos.faults.{i}.server: {fault.server} >= the run's {servers} rollout servers "
                                 "(rollout.engine.server_urls, else num_servers)")
        if fault.kind in IN_PROCESS_FAULTS:
            if engine.deployment != "in_process":
                raise ValueError(f"chaos.faults.{i}.kind: {fault.kind} needs rollout.engine.deployment=in_process "
                                 f"({fault.kind.replace('engine', 'server')} is a server's)")
            if not cfg.schedule.on_policy or engine.max_restarts == 0:
                raise ValueError(f"chaos.faults.{i}.kind: {fault.kind} is survived in place under schedule.mode "
                                 f"sync or thunder with rollout.engine.max_restarts >= 1 (now "
                                 f"{cfg.schedule.mode}, {engine.max_restarts})")
        if fault.kind == "stale_push":
            if engine.deployment != "in_process" or cfg.probe.tokens == 0:
                raise ValueError(f"chaos.faults.{i}.kind: stale_push needs rollout.engine.deployment=in_process "
                                 "and the probe (probe.tokens > 0), which must catch it")
        dp = cfg.learner.parallel.data_parallel  # the world size is known here only when it is set
        if fault.kind in LEARNER_FAULTS and dp is not None:
            par = cfg.learner.parallel
            world = par.tensor_parallel * par.pipeline_parallel * par.context_parallel * dp
            if fault.rank >= world:
                raise ValueError(f"chaos.faults.{i}.rank: {fault.rank} >= the learner's world size {world} "
                                 "(learner.parallel: tensor x pipeline x context x data)")
        if fault.kind in ("hang_sandbox", "oom_tool") and isinstance(cfg.task, GeneratedTaskConfig):
            raise ValueError(f"chaos.faults.{i}.kind: {fault.kind} takes an episode's own bash tool call; task "
                             f"{cfg.task.name} has no bash tool (terminal, swe_local and the dataset tasks do)")
        if fault.kind in EPISODE_FAULTS:
            size = cfg.batch.num_prompts_per_batch * cfg.batch.samples_per_prompt
            if max(fault.trajectories) >= size:
                raise ValueError(f"chaos.faults.{i}.trajectories: {max(fault.trajectories)} >= the batch's "
                                 f"{size} trajectories (batch.num_prompts_per_batch x samples_per_prompt)")
        if fault.kind == "corrupt_journal":
            every = cfg.run.checkpoint_every
            if not every or every > fault.step:
                raise ValueError(f"chaos.faults.{i}.step: corrupt_journal at step {fault.step} needs a "
                                 f"checkpoint before it to resume from (run.checkpoint_every={every}: "
                                 "1..step)")
        if fault.step >= cfg.run.num_steps:
            raise ValueError(f"chaos.faults.{i}.step: {fault.step} >= run.num_steps={cfg.run.num_steps}")


# ---------------------------------------------------------------------- sampling and staleness


def on_policy_samples_are_untruncated(cfg: Sections) -> None:
    """sync and thunder train the distribution sampled: the learner reproduces the temperature,
    not a truncation of the vocabulary."""
    if cfg.schedule.on_policy:
        r = cfg.rollout
        if r.top_p < 1:
            raise ValueError(f"rollout.top_p: {r.top_p} truncates the sampled distribution, whose logprobs the "
                             f"learner does not reproduce; schedule.mode={cfg.schedule.mode} trains exactly "
                             "on-policy: use 1.0 (or async / fully_async with objective.tis)")
        if r.top_k != -1:
            raise ValueError(f"rollout.top_k: {r.top_k} truncates the sampled distribution, whose logprobs the "
                             f"learner does not reproduce; schedule.mode={cfg.schedule.mode} trains exactly "
                             "on-policy: use -1 (or async / fully_async with objective.tis)")


def thunder_takes_one_step_per_batch(cfg: Sections) -> None:
    """Thunder streams one optimizer step per batch; anything else is not exact."""
    obj = cfg.objective
    if cfg.schedule.mode != "thunder" or not isinstance(obj, RLObjective):
        return
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


def off_policy_batches_are_corrected(cfg: Sections) -> None:
    """async / fully_async sample with older policies: the gradient needs an importance correction."""
    obj = cfg.objective
    if cfg.schedule.mode not in ("async", "fully_async") or not isinstance(obj, RLObjective):
        return
    if obj.tis == "none" and obj.ppo_old_logprobs == "learner" and not obj.allow_uncorrected_off_policy:
        raise ValueError(
            f"objective.tis: schedule.mode={cfg.schedule.mode} trains on samples of older policies; "
            "correct for it with objective.tis (token or sequence) or objective.ppo_old_logprobs=rollout, "
            "or set objective.allow_uncorrected_off_policy=true"
        )


# ---------------------------------------------------------------------- distillation


def distillation_trains_its_own_samples(cfg: Sections) -> None:
    obj = cfg.objective
    if not isinstance(obj, DistillObjective):
        return
    if not cfg.schedule.on_policy:
        raise ValueError(
            f"schedule.mode: objective.kind={obj.kind} trains on the student's own samples (sync or "
            f"thunder); {cfg.schedule.mode} would train on stale samples"
        )
    if cfg.learner.parallel.pipeline_parallel > 1:  # a turn's forward is a plain model call
        raise ValueError(f"learner.parallel.pipeline_parallel: objective.kind={obj.kind} runs each turn's "
                         "forward as one model call, not a pipeline schedule; use 1")
    if cfg.learner.parallel.context_parallel > 1:
        raise ValueError(f"learner.parallel.context_parallel: objective.kind={obj.kind} forwards each turn "
                         "as one model call on the whole segment; use 1")
    if cfg.learner.parallel.sequence_parallel:
        raise ValueError(f"learner.parallel.sequence_parallel: objective.kind={obj.kind} forwards each turn "
                         "segment as one model call of its own length, which sequence parallelism would split "
                         "over the TP ranks; use false")
    if obj.strategy != "recompute" and cfg.learner.precision.core_attention != "past_kv":
        raise ValueError(f"objective.strategy: {obj.strategy} needs learner.precision.core_attention=past_kv")
    if isinstance(obj, OPDGRPOObjective) and cfg.verifier.on_failure == "drop_group":
        raise ValueError("verifier.on_failure: drop_group cannot be combined with opd_grpo (a dropped "
                         "group's KL terms are already streamed); use zero_reward")


# ---------------------------------------------------------------------- per-turn score gradients


def per_turn_scores_stream_exactly(cfg: Sections) -> None:
    """Per-turn score gradients: what ``megathunder.streaming.grpo_turns`` can stream exactly."""
    strategy = cfg.ledger.per_turn_scores
    if strategy == "off" or cfg.schedule.mode != "thunder":  # only thunder streams a batch's gradient
        return
    obj, par = cfg.objective, cfg.learner.parallel
    field = f"ledger.per_turn_scores: {strategy}"
    if obj.kind != "grpo":
        raise ValueError(f"{field} streams GRPO's score term; objective.kind={obj.kind} (opd_grpo's turns "
                         "already stream its KL term; use off)")
    assert isinstance(obj, RLObjective)
    if cfg.ledger.max_pending == 0:
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
    if strategy != "recompute" and cfg.learner.precision.core_attention != "past_kv":
        raise ValueError(f"{field} needs learner.precision.core_attention=past_kv")
    if cfg.learner.model.is_moe or (cfg.run.init_model == "tiny" and cfg.run.tiny_model.num_experts):
        raise ValueError(f"{field}: a MoE model's router losses and routing replay do not run in a turn's "
                         "forward; use off")


# ---------------------------------------------------------------------- mixture of experts


def routing_replay_records_what_it_replays(cfg: Sections) -> None:
    """Routing replay: the engine records what the learner replays."""
    if not cfg.learner.moe.routing_replay:
        return
    if not cfg.schedule.on_policy:
        raise ValueError(f"learner.moe.routing_replay: needs schedule.mode sync or thunder (under "
                         f"{cfg.schedule.mode} a weight push between an episode's turns would clear the "
                         "engine's record of its earlier turns)")
    if isinstance(cfg.objective, DistillObjective):
        raise ValueError(f"learner.moe.routing_replay: objective.kind={cfg.objective.kind} forwards turns "
                         "outside the replayed schedule; use grpo")
    if not cfg.rollout.engine.record_routing:  # (assignment validates again: set once)
        engine = cfg.rollout.engine.model_copy(update={"record_routing": True})
        cfg.rollout = cfg.rollout.model_copy(update={"engine": engine})


def experts_divide_the_built_model(cfg: Sections) -> None:
    """The expert layout against the model the run builds, where it is known before any file is
    read: the tiny model (``run.init_model: tiny``) or ``learner.model``'s own sizes."""
    m = cfg.learner.model
    if m.hf_checkpoint is not None or m.is_moe:
        return  # read from config.json when built / checked by the learner section
    if cfg.run.init_model != "tiny":
        return  # a checkpoint directory: checked when read
    t = cfg.run.tiny_model
    tiny = m if not t.num_experts else m.model_copy(update=dict(
        family="qwen3_moe", num_experts=t.num_experts, moe_router_topk=t.num_experts_per_tok,
        moe_ffn_hidden_size=t.moe_intermediate_size))
    try:
        check_experts_divide_model(tiny, cfg.learner.parallel)
    except ValueError as err:
        raise ValueError(f"learner.{err}".replace("model.num_experts is null", "run.tiny_model.num_experts is 0")
                         .replace("model.num_experts", "run.tiny_model.num_experts")
                         .replace("model.moe_ffn_hidden_size", "run.tiny_model.moe_intermediate_size")) from None


Rule = Callable[[Sections], None]

RULES: tuple[Rule, ...] = (
    tasks_run_where_their_files_are,
    verifiers_run_where_the_sandboxes_are,
    cores_are_disjoint,
    failed_groups_stay_droppable,
    faults_fit_the_run,
    routing_replay_records_what_it_replays,
    refill_needs_dropped_groups,
    distillation_trains_its_own_samples,
    per_turn_scores_stream_exactly,
    experts_divide_the_built_model,
    on_policy_samples_are_untruncated,
    thunder_takes_one_step_per_batch,
    off_policy_batches_are_corrected,
)
"""In the order they run (a derive rule before those that read what it sets; with several broken,
the first one is the error reported)."""
