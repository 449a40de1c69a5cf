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
    loss_agg: LossAggregation = "token_mean"
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
    def _check_norm_tokens(self) -> RLObjective:
        if self.loss_agg == "seq_mean_token_sum_norm" and self.loss_agg_norm_tokens is None:
            raise ValueError("loss_agg_norm_tokens: required when loss_agg is seq_mean_token_sum_norm")
        return self

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
    reward_free_terms: Literal["with_score", "at_finish"] = "with_score"
    """When KL/entropy gradients are computed: in the same forward as the trajectory's score
    gradient (fewest passes), or as soon as the trajectory finishes (earliest)."""
    hold_groups_until_close: bool = False
    """Keep every part of a group's gradient in its slot until all its rewards are in, so a group
    can still be dropped at its last reward (a failed trajectory). Derived: true whenever
    ``verifier.on_failure`` is ``drop_group``."""
