"""The training objective (``objective``: one of three kinds) and the gradient ledger (``ledger``).

``objective.kind`` selects which fields exist:

    grpo       reward RL: advantages, aggregation, surrogate, KL / entropy terms, TIS, DAPO
    opd        on-policy distillation: the per-token reverse KL (or the GKD generalized JSD) of the
               student's own samples to a frozen teacher, streamed per turn under thunder
    opd_grpo   both, one normaliser: the KL term streamed per turn, the reward term through the
               gradient ledger (``megathunder.streaming.opd_grpo``)
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from megathunder.config.base import Strict

TurnStrategy = Literal["recompute", "kv_adjoint", "forward_early"]
LossAggregation = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
OPDAggregation = Literal["token_mean", "seq_mean_token_sum"]
"""The aggregations a per-turn streamed divergence supports (``megathunder.objectives.opd``)."""


class _Kind(Strict):
    kind: str  # each kind narrows it to its Literal (listed first in a saved config)


class RLObjective(_Kind):
    """The reward part: advantages, loss aggregation, regularisers, corrections (GRPO's family)."""

    advantage: Literal["grpo", "dr_grpo", "rloo", "batch_std"] = "grpo"
    """grpo: (r - mean_g) / (std_g + eps); dr_grpo: r - mean_g; rloo: leave-one-out baseline;
    batch_std: (r - mean_g) / (std over the batch of r - mean_g, + eps)."""
    std_eps: float = Field(1e-6, gt=0)
    std_unbiased: bool = True
    singleton_group: Literal["zero", "raw_score"] = "zero"
    """A group of one sample has no baseline. zero: its advantage is 0 (it trains nothing).
    raw_score: verl's convention, mean 0 and std 1 -- A = r / (1 + std_eps) for grpo, r for
    dr_grpo and rloo (batch_std: r before the batch scaling)."""
    loss_agg: LossAggregation = "token_mean"
    loss_agg_norm_tokens: int | None = Field(None, gt=0)
    """Constant token count of seq_mean_token_sum_norm (Dr.GRPO): Z = num_sequences * this."""
    policy_loss: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
    clip_eps_low: float = Field(0.2, ge=0)
    clip_eps_high: float = Field(0.28, ge=0)
    clip_ratio_c: float | None = Field(None, gt=1)
    """Dual-clip PPO (verl's ``clip_ratio_c``, 3.0 there): for a negative advantage the per-token loss
    is also bounded by -A * clip_ratio_c, so a huge ratio cannot blow the update up. null: off."""
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0)
    tis: Literal["none", "token", "sequence"] = "none"
    """Truncated importance sampling between rollout-engine and learner logprobs (detached)."""
    tis_cap: float = Field(2.0, gt=0)
    dapo_dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (zero std) from the gradient and the normaliser."""
    dapo_singletons: Literal["drop", "keep"] = "drop"
    """Under dynamic sampling, a group of one sample (all its rewards equal, trivially): drop it as
    any other, or keep it as verl's DAPO recipe does (it keeps groups of one). A kept singleton
    trains its reward-free terms, and its score term under ``singleton_group: raw_score``."""
    overlong_filter: bool = False
    """Mask the loss of truncated trajectories (they still count in their group's statistics)."""
    num_ppo_epochs: int = Field(1, ge=1)
    """PPO epochs over each batch (sync, async, fully_async; thunder: 1). Each epoch takes the batch's
    kept trajectories in order, as ``num_minibatches_per_batch`` mini-batches, one optimizer step
    each; advantages and the old logprobs are fixed once per batch (``megathunder.objectives.ppo``)."""
    num_minibatches_per_batch: int = Field(1, ge=1)
    """Optimizer steps per epoch (verl: batch size / ppo_mini_batch_size); each mini-batch is
    normalised by its own Z."""
    ppo_old_logprobs: Literal["learner", "rollout"] = "learner"
    """The policy the PPO ratio is taken against. learner: the learner's logprobs at the batch's
    start, recomputed once (verl's old_log_prob; ratio 1 in the first mini-batch, TIS corrects
    towards the engine's sampling policy). rollout: the engine's logprobs of the sampled tokens, the
    behaviour policy itself -- under async the clip then bounds the move away from the stale policy
    that sampled (no TIS on top: the ratio is the importance weight)."""
    allow_uncorrected_off_policy: bool = False
    """async / fully_async train on samples of older policies: refused without an importance
    correction (``tis`` or ``ppo_old_logprobs: rollout``) unless this is set."""
    skip_zero_advantage: bool = True
    """A trajectory whose advantage is exactly 0 (every reward of its group equal, under every
    advantage but ``singleton_group: raw_score``) and whose loss has no reward-free term (KL,
    entropy, MoE router losses) has a gradient of exactly 0: no forward or backward runs for it.
    The update is the same (its loss tokens still count in the normaliser); only the reports of
    the skipped trajectories (entropy, clip fractions) are missing. false: run them anyway."""

    @model_validator(mode="after")
    def _check_norm_tokens(self) -> RLObjective:
        if self.loss_agg == "seq_mean_token_sum_norm" and self.loss_agg_norm_tokens is None:
            raise ValueError("loss_agg_norm_tokens: required when loss_agg is seq_mean_token_sum_norm")
        if self.ppo_old_logprobs == "rollout" and self.tis != "none":
            raise ValueError(f"tis: {self.tis} on top of ppo_old_logprobs=rollout would weight twice (the PPO ratio "
                             "against the engine's logprobs is already the importance weight); use tis: none")
        if self.clip_ratio_c is not None and self.policy_loss != "ppo_clip":
            raise ValueError(f"clip_ratio_c: dual clip is a ppo_clip option; policy_loss is {self.policy_loss}")
        return self

    @property
    def num_updates_per_batch(self) -> int:
        return self.num_ppo_epochs * self.num_minibatches_per_batch

    @property
    def needs_old_logprobs(self) -> bool:
        """The ratio is not 1 everywhere: more than one update per batch, or taken against the engine."""
        return self.num_updates_per_batch > 1 or self.ppo_old_logprobs == "rollout"

    @property
    def has_reward_free_terms(self) -> bool:
        return self.kl_coef > 0 or self.entropy_coef > 0

    @property
    def needs_teacher(self) -> bool:
        return False


class TeacherConfig(Strict):
    """OPD's teacher, run as a frozen Megatron model in the student's parallel layout."""

    hf_checkpoint: str | None = None
    """A Hugging Face directory with the student's tokenizer, any size. null: the run builds one --
    the default tiny model, SFT-warm-started for ``sft_num_steps`` (``sft.batch_size``, ``sft.lr``)."""
    sft_num_steps: int = Field(40, ge=1)


class Distillation(_Kind):
    """What both distillation kinds share: how each turn's gradient is computed, and the teacher."""

    strategy: TurnStrategy = "kv_adjoint"
    """How each completed turn's gradient is computed (docs/exactness.md; figures in BENCHMARKS.md):
    recompute (stock autograd over prefix + turn), kv_adjoint or forward_early (both need
    ``learner.precision.core_attention=past_kv`` and no pipeline parallelism)."""
    beta: float = Field(1.0, gt=0)
    """Coefficient of the per-token divergence to the teacher."""
    teacher: TeacherConfig = TeacherConfig()
    max_cached_trajectories: int | None = Field(16, ge=0)
    """Per learner rank: trajectories in flight whose per-turn state is kept (the student's segment
    K/V and graphs under kv_adjoint / forward_early, the teacher's K/V cache). A trajectory that
    starts while this many are open streams with ``recompute`` and an uncached teacher instead --
    the same gradient, no state between turns. null: unbounded; 0: every trajectory recomputes."""

    @property
    def needs_teacher(self) -> bool:
        return True


class GRPOObjective(RLObjective):
    """``kind: grpo``: reward RL with the advantage, aggregation and terms above."""

    kind: Literal["grpo"] = "grpo"


class OPDObjective(Distillation):
    """``kind: opd``: on-policy distillation only (rewards are logged, not trained on)."""

    kind: Literal["opd"] = "opd"
    aggregation: OPDAggregation = "token_mean"
    divergence: Literal["reverse_kl", "gjsd"] = "reverse_kl"
    """reverse_kl: per-token l - l^T as a policy-gradient advantage; gjsd: GKD's generalized
    Jensen-Shannon divergence over the vocabulary (the teacher's whole distribution)."""
    jsd_lam: float = Field(0.5, gt=0, lt=1)
    """Mixture weight of the teacher in the gjsd's M = lam P_T + (1 - lam) P_S."""


class OPDGRPOObjective(Distillation, RLObjective):
    """``kind: opd_grpo``: the reverse-KL term plus the reward term under one normaliser Z (the
    reward part's ``loss_agg``: token_mean or seq_mean_token_sum)."""

    kind: Literal["opd_grpo"] = "opd_grpo"

    @model_validator(mode="after")
    def _check_streamable_together(self) -> OPDGRPOObjective:
        if self.loss_agg not in ("token_mean", "seq_mean_token_sum"):
            raise ValueError(f"loss_agg: {self.loss_agg} cannot be combined with per-turn OPD "
                             "(opd_grpo: token_mean or seq_mean_token_sum)")
        if self.dapo_dynamic_sampling:
            raise ValueError("dapo_dynamic_sampling: a dropped group's KL terms are already streamed; "
                             "it cannot be combined with opd_grpo")
        if self.has_reward_free_terms:
            raise ValueError("kl_coef: KL-to-reference and entropy terms cannot be combined with opd_grpo "
                             "(they would double the per-token regulariser)")
        if self.needs_old_logprobs:
            raise ValueError("num_ppo_epochs: opd_grpo trains one update per batch on the student's own samples "
                             "(num_ppo_epochs, num_minibatches_per_batch: 1; ppo_old_logprobs: learner)")
        return self

    @property
    def aggregation(self) -> OPDAggregation:
        """Both parts are normalised by the reward part's Z."""
        agg = self.loss_agg
        assert agg in ("token_mean", "seq_mean_token_sum")  # checked by the validator
        return agg

    @property
    def divergence(self) -> Literal["reverse_kl"]:
        return "reverse_kl"

    @property
    def jsd_lam(self) -> float:
        return 0.5  # unused: reverse_kl


ObjectiveConfig = Annotated[GRPOObjective | OPDObjective | OPDGRPOObjective, Field(discriminator="kind")]
"""The ``objective`` section: one of the three kinds."""
DistillObjective = OPDObjective | OPDGRPOObjective


class LedgerConfig(Strict):
    """The gradient ledger: how many groups may stream per trajectory at once, and where their
    buffers live (``megathunder.streaming.buffers``; the bound and the costs in docs/exactness.md,
    section 2.7)."""

    max_group_slots: int | None = Field(None, ge=0)
    """K: groups that accumulate per-trajectory gradients while open (2 parameter-sized buffers
    each, 1 for std-free advantages). 0 = group-level streaming; null = unbounded, unless
    ``slot_budget_gb`` bounds it."""
    slot_budget_gb: float | None = Field(None, ge=0)
    """GiB the slot buffers may take on each rank, in their placement; K is then the smaller of
    ``max_group_slots`` and the number of slots that fit (each slot counted at its largest: 2
    buffers, or 1 for std-free advantages). Set it, leave K null, and K follows the model's size."""
    slot_dtype: Literal["gradient", "bfloat16"] = "gradient"
    """gradient: the gradient buffers' own dtype (fp32 on the Megatron learner), exact as before.
    bfloat16: half of fp32's memory; every add into a slot rounds to bf16 once, an error bounded
    in docs/exactness.md (section 2.7)."""
    slot_placement: Literal["device", "host"] = "device"
    """device: slot buffers next to the gradient. host: in (pinned) host memory; each gradient
    goes down through one device staging buffer while the next backward runs, and is added on a
    host thread; the update is the same as with device slots. On a CPU learner both are the same
    memory."""
    host_threads: int = Field(4, ge=1, le=64)
    """With ``slot_placement: host``: threads that add a staged gradient into host slots, each
    taking an equal chunk of every tensor (elementwise, so the sums are bitwise those of one
    thread). One thread adds ~1e9 fp32 elements/s, a 32B model's 2B-parameter TP8 x PP2 shard in
    ~2 s per buffer (``megathunder bench hostadd`` measures it)."""
    host_chunk_mb: float = Field(256.0, ge=0)
    """With ``slot_placement: host`` on a GPU: each gradient goes down in chunks of this many MiB on
    the side stream, each chunk added on the host while the next is on the wire (0: the whole
    buffer, then the add). The values added are the same either way."""
    reward_free_terms: Literal["with_score", "at_finish"] = "with_score"
    """When KL/entropy gradients are computed: in the same forward as the trajectory's score
    gradient (fewest passes), or as soon as the trajectory finishes (earliest)."""
    pack_ready_work: bool = True
    """Ready-work packing (thunder): an event that finds more learner calls queued behind it only
    records what it makes known; the call that finds the queue empty runs every backward pass
    held back so, closed groups' members of all groups in one packed schedule call
    (``GradientLedger.hold`` / ``release``). The same update up to fp32 reassociation; which
    events were held depends on the learner's timing, which the journal does not record, so a
    replay (``megathunder replay``) reproduces such a run within rounding, bitwise only with false."""
    pack_own_passes: bool = True
    """Passes that need each trajectory's gradient on its own (a slot's S and R, a pending h_i),
    when several are ready at once, go in one call (``backward_each``: on a pipelined learner the
    trajectories fill the pipeline instead of each running alone through its stages); bitwise the
    update of one call each (``megathunder.streaming.ledger``: Packed own gradients). false: one
    call each."""
    pack_window_s: float = Field(0.02, ge=0.0, le=1.0)
    """With ``pack_ready_work``: an event that reaches an idle learner waits up to this long for the
    next event before its work runs, so a burst of events (a batch of sequences finishing in one
    engine step) goes in one packed call instead of a one-trajectory backward pass the rest of the
    burst waits behind. 0: run at once. Only the timing changes, never what is computed."""
    hold_while_generating: Literal["in_process", "never"] = "in_process"
    """With ``pack_window_s`` > 0: where the rollout engine generates on the learner's own cores or
    devices (in_process: ``rollout.engine.deployment=in_process``, unless ``learner.cpu_cores`` and
    ``rollout.engine.cpu_cores`` give each side its own cores), an event's window stays open
    while any sequence is still generating (a turn counts from its call to the engine, before vLLM
    has queued it: ``InProcessEngine.busy``), so no backward pass takes compute from them; the held
    work goes in one packed call when the next event comes or generation pauses (tool calls,
    verifiers, the batch's end) and ``pack_window_s`` more has passed (the sequences of the last
    engine steps arrive just after it stops). never: the window is ``pack_window_s`` alone. Only
    the timing changes, never what is computed."""
    max_pending: int | None = Field(0, ge=0)
    """Gradients before the reward: a trajectory's score gradient h_i is computed when it finishes,
    while its verifier runs, and kept in a *pending* parameter-sized buffer (the slots' dtype and
    placement) until its reward folds it into its group's slot or into P without a new backward.
    The most pending buffers at once on each rank: 0 = off (h_i at reward time, as without it);
    null = as many as ``slot_budget_gb`` leaves after K slots at their largest (unbounded without a
    budget: up to one per trajectory of the batch). A trajectory finding none takes the
    reward-time path. Off by default: it adds buffers the budget must be sized for."""
    per_turn_scores: Literal["off", "recompute", "kv_adjoint", "forward_early"] = "off"
    """Per-turn score gradients (thunder, ``objective.kind: grpo``, multi-turn episodes): a
    trajectory's h_i is computed turn by turn, each model turn's part while its tool call runs, into
    a pending buffer (``max_pending``; none free: the trajectory takes the finish-time path), so at
    its finish only a backward is left (``megathunder.streaming.grpo_turns``). The value is the
    strategy, as OPD's ``objective.strategy``: forward_early (each turn's forward at the turn, the
    one backward at the finish: one pass's work in all) is the one to use; kv_adjoint runs each
    turn's backward at the turn too but adds a K/V adjoint sweep at the finish (up to 2/3 more
    work); recompute re-runs the prefix every turn. kv_adjoint and forward_early need
    ``learner.precision.core_attention=past_kv``. Needs ``objective.tis`` none or token and a ``loss_agg``
    whose per-trajectory weight is 1 (not seq_mean_token_mean); no pipeline / context / sequence
    parallelism, no MoE. off: h_i at finish or reward time."""
    max_turn_streams: int | None = Field(None, ge=1)
    """With ``per_turn_scores`` kv_adjoint or forward_early: the most trajectories streamed by turns
    at once on each rank, each keeping its segments' graphs (activations) until it ends; one that
    starts beyond it takes the finish-time path. null: bounded by the pending buffers and by
    ``agent.max_concurrent_episodes`` (what ``megathunder plan`` counts)."""
    defer_uniform_groups: bool = True
    """A group takes a slot only once two of its rewards differ: until then its rewarded
    trajectories wait as data (as for a slot when none is free). With binary rewards most groups
    of hard tasks fail every sample; such a group closes with every advantage 0, and with
    ``objective.skip_zero_advantage`` none of its trajectories ever runs (false: each ran its slot
    pass when its reward came). A group that turns out mixed processes its waiting trajectories the
    moment its first different reward arrives (those with the common reward first, so they write S
    alone). Only when each pass runs changes, never what it computes. It acts only where a uniform
    group's passes are then skipped (``objective.skip_zero_advantage`` and no KL, entropy or router
    loss term); elsewhere it would only delay them. Simulated on the SWE-smith profiles: thunder
    1.19x faster on 8 GPUs, 1.03x on 128 (BENCHMARKS.md, ``megathunder simulate``)."""
    hold_groups_until_close: bool = False
    """Keep every part of a group's gradient in its slot until all its rewards are in, so a group
    can still be dropped at its last reward (a failed trajectory). Derived: true whenever
    ``verifier.on_failure`` is ``drop_group``."""
