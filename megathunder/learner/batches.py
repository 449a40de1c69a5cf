"""One batch's gradient on one learner rank, from its trajectories' events: one class per objective.

Every batch takes the same events in the order they happened -- ``on_turn`` (a model turn was
generated), ``on_finished`` (a trajectory ended), ``on_reward`` -- then ``close``, and each class
has both paths:

    streamed  (thunder)  every event's work when it happens; ``close`` divides by Z once
    at_end    (sync)     the events are recorded; ``close`` computes the batch-synchronous gradient

Both leave this rank's share of (1/Z) sum_i grad loss_i in DDP's gradient buffers; ``step`` then
reduces it over data-parallel ranks once. Why the two paths give the same gradient is derived
where the math lives:

    GRPOBatch     objective.kind grpo      the gradient ledger          ``megathunder.streaming.ledger``
    OPDBatch      objective.kind opd       the per-turn streamer        ``megathunder.streaming.opd_turns``
    OPDGRPOBatch  objective.kind opd_grpo  both, under one Z            ``megathunder.streaming.opd_grpo``

The batch-synchronous gradients are also functions of their own (``grpo_gradient``,
``opd_gradient``, ``opd_grpo_gradient``): the references the tests compare the streamed paths with.

Data parallelism (``Ownership``): a trajectory is owned by the DP rank that has been given the
fewest loss tokens when the trajectory is first seen (ties to the lowest rank): at its finish
(GRPO), at its first turn (OPD, streamed; later turns add to that rank's load) or at its finish
(OPD at the end). The choice depends only on the order of events, which every rank receives
identically, so ranks agree without talking; TP/PP peers share the DP rank and so receive the
same trajectories in the same order. Only the owner runs a trajectory's backward passes; every
rank counts every trajectory, so Z is the whole batch's.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megathunder.config import ConfigError, DistillObjective, OPDAggregation, RLObjective
from megathunder.learner.learner import MegatronLearner
from megathunder.objectives import LossSpec, normaliser, num_loss_tokens
from megathunder.objectives.opd import opd_normaliser
from megathunder.objectives.ppo import update_plan
from megathunder.streaming.buffers import GradBuffer
from megathunder.streaming.grpo_turns import ScoreTurns
from megathunder.streaming.ledger import BatchResult, GradientLedger
from megathunder.streaming.opd_grpo import IntoAccumulator
from megathunder.streaming.opd_turns import (
    CachedTeacher,
    TurnStreamer,
    accumulate_full_trajectory_gjsd,
    accumulate_full_trajectory_opd,
)
from megathunder.streaming.reference import batch_advantages
from megathunder.trajectory import BatchPlan, Trajectory


@dataclass(frozen=True)
class BatchOutcome(BatchResult):
    """What ``close`` reports: the ledger's figures plus the learner work left after the last reward."""

    backward_after_last_reward: int = 0  # this rank's backward passes after the batch's last reward
    divergence: float | None = None  # OPD: the student's mean per-token divergence to the teacher


@dataclass(frozen=True)
class OPDTotals:
    normaliser: float  # Z of the whole batch (every data-parallel rank's trajectories)
    divergence_mean: float  # per trained token over the batch: the sampled-token reverse KL (or GJSD)


class Ownership:
    """The data-parallel owner of each trajectory (module docstring)."""

    def __init__(self, dp: int, dp_rank: int) -> None:
        self.load = [0] * dp
        self.owner: dict[int, int] = {}
        self.dp_rank = dp_rank

    def claim(self, traj_id: int, num_tokens: int) -> bool:
        """A trajectory's next ``num_tokens`` loss tokens: assigned to the least-loaded rank the first
        time it is seen, added to its owner's load afterwards. True when this rank owns it."""
        if traj_id not in self.owner:
            self.owner[traj_id] = min(range(len(self.load)), key=lambda r: (self.load[r], r))
        self.load[self.owner[traj_id]] += num_tokens
        return self.owner[traj_id] == self.dp_rank

    def settle(self, traj_id: int, num_tokens: int) -> bool:
        """Its owner: claimed with ``num_tokens`` unless it already has one. True when it is this rank."""
        return self.claim(traj_id, num_tokens) if traj_id not in self.owner else self.is_mine(traj_id)

    def is_mine(self, traj_id: int) -> bool:
        return self.owner[traj_id] == self.dp_rank


class Batch(abc.ABC):
    """What every objective's batch shares: its plan, its path, DP ownership, and the count of
    backward passes the learner still had to run after the batch's last reward."""

    def __init__(self, learner: MegatronLearner, plan: BatchPlan, streamed: bool) -> None:
        self.learner, self.plan, self.streamed = learner, plan, streamed
        self.owners = Ownership(learner.pgs.dims.data_units, learner.pgs.data_unit)
        self._passes_at_last_reward = 0
        self._passes_before = learner.forward_backward.num_passes  # the learner's passes before this batch

    @abc.abstractmethod
    def passes(self) -> int:
        """Backward passes this rank has run for the batch so far."""

    def add_group(self, group_id: int, traj_ids: list[int]) -> None:
        """A group joins the batch after ``begin`` (``batch.max_refill_groups``), placed after the others."""
        raise ConfigError(f"batch.max_refill_groups: objective.kind={self.learner.objective.kind} has no groups "
                          "to drop, so none to refill")

    def on_turn(self, traj_id: int, tokens: list[int], start: int, end: int,
                logprobs: list[float] | None = None) -> None:
        """Turn ``tokens[start:end]`` of a trajectory was generated (``tokens``: the trajectory so far;
        ``logprobs``: the engine's, of the turn's tokens)."""

    @abc.abstractmethod
    def on_finished(self, traj: Trajectory) -> None:
        """A trajectory ended (its reward is still to come)."""

    def on_reward(self, traj_id: int, reward: float | None) -> None:
        """``None``: the trajectory failed and its group leaves the batch (``verifier.on_failure:
        drop_group``)."""
        if self.streamed:  # at the end, every pass follows the last reward
            self._passes_at_last_reward = self.passes()

    @abc.abstractmethod
    def close(self) -> BatchOutcome:
        """Every event is in: leave this rank's share of the batch's gradient in DDP's buffers."""

    def holds_work(self) -> bool:
        """Does ``hold_work`` hold anything (streamed GRPO with ``ledger.pack_ready_work``)?"""
        return False

    def hold_work(self) -> None:
        """More events are queued behind the next one: hold back the backward passes events make
        due until ``release_work`` (streamed GRPO: ``GradientLedger.hold``), so what is ready
        then goes in one packed schedule call. Default: nothing is held."""

    def release_work(self) -> None:
        """The learner is free: run what ``hold_work`` held back."""

    def _left_after_last_reward(self) -> int:
        return self.passes() - self._passes_at_last_reward

    def _schedule_passes(self) -> int:
        """The passes this batch ran through the learner's forward-backward (the ledger's, the
        batch-synchronous gradients'), from the counts its calls returned."""
        return self.learner.forward_backward.num_passes - self._passes_before


def _ledger(learner: MegatronLearner) -> GradientLedger:
    if learner.ledger is None:
        raise TypeError(f"objective.kind={learner.objective.kind} has no reward part (no gradient ledger)")
    return learner.ledger


def _rl(learner: MegatronLearner) -> RLObjective:
    if not isinstance(learner.objective, RLObjective):
        raise TypeError(f"objective.kind={learner.objective.kind} has no reward part")
    return learner.objective


def _distill(learner: MegatronLearner) -> DistillObjective:
    if not isinstance(learner.objective, DistillObjective):
        raise TypeError(f"objective.kind={learner.objective.kind} has no distillation part")
    return learner.objective


def _kept_rewards(rewards: Mapping[int, float | None], order: Sequence[int]) -> list[float]:
    """The rewards of ``order``'s trajectories, all of kept groups (a None reward drops its group)."""
    known = [r for r in (rewards[t] for t in order) if r is not None]
    assert len(known) == len(order), "internal: a trajectory of a kept group has no reward"
    return known


def new_batch(learner: MegatronLearner, teacher: CachedTeacher | None, plan: BatchPlan, streamed: bool) -> Batch:
    """The batch of ``learner``'s objective (``objective.kind``); the distillation kinds need the teacher."""
    kind = learner.objective.kind
    if kind == "grpo":
        return GRPOBatch(learner, plan, streamed)
    if teacher is None:
        raise ConfigError(f"objective.kind: {kind} needs a teacher")
    return (OPDGRPOBatch if kind == "opd_grpo" else OPDBatch)(learner, teacher, plan, streamed)


# ---------------------------------------------------------------------- GRPO


class GRPOBatch(Batch):
    """GRPO and its variants: streamed through the gradient ledger, or ``grpo_gradient`` at close.
    Streamed with ``ledger.per_turn_scores``, each turn's part of h_i runs at the turn
    (``megathunder.streaming.grpo_turns``); the trajectory's owner is then claimed at its first turn."""

    def __init__(self, learner: MegatronLearner, plan: BatchPlan, streamed: bool) -> None:
        super().__init__(learner, plan, streamed)
        self.ledger = _ledger(learner)
        self.group_of = {tid: g for g, members in plan for tid in members}
        self.trajs: dict[int, Trajectory] = {}
        self.rewards: dict[int, float | None] = {}
        self.dropped: set[int] = set()  # groups excluded (a failed trajectory)
        self.turns: ScoreTurns | None = None
        if streamed:
            self.ledger.begin_batch(plan)
            strategy = self.ledger.config.per_turn_scores
            if strategy != "off":
                self.turns = ScoreTurns(self.ledger, learner.segments(), learner.gradients.live, strategy=strategy,
                                        max_streams=self.ledger.config.max_turn_streams)

    def passes(self) -> int:
        turn_passes = self.turns.stats["backward_calls"] if self.turns is not None else 0
        return self._schedule_passes() + turn_passes  # streamed: the ledger's; at the end: the reward terms'

    def on_turn(self, traj_id: int, tokens: list[int], start: int, end: int,
                logprobs: list[float] | None = None) -> None:
        if self.turns is not None and start < end and self.owners.claim(traj_id, end - start):
            self.turns.on_turn(traj_id, tokens, start, end, logprobs)

    def add_group(self, group_id: int, traj_ids: list[int]) -> None:
        if self.streamed:
            self.ledger.add_group(group_id, traj_ids)  # checks it first: the batch is unchanged if it raises
        elif group_id in {g for g, _ in self.plan} or set(traj_ids) & set(self.group_of):
            raise ValueError(f"add_group: group {group_id} or one of its trajectories {traj_ids} is already in the batch")
        self.plan = [*self.plan, (group_id, list(traj_ids))]
        self.group_of.update({tid: group_id for tid in traj_ids})

    def on_finished(self, traj: Trajectory) -> None:
        n = self.learner.num_loss_tokens(traj)
        mine = self.owners.settle(traj.traj_id, n)
        if mine and self.learner.reference is not None:
            self.learner.fill_ref_logprobs([traj])
        if not self.streamed:
            self.trajs[traj.traj_id] = traj  # the batch path needs every trajectory's size
        elif mine:
            if self.turns is not None:
                self.turns.on_finished(traj)  # its h_i complete (the adjoint sweep), or given back
            self.ledger.on_finished(traj)
        else:
            self.ledger.on_remote_finished(traj.traj_id, n)

    def on_reward(self, traj_id: int, reward: float | None) -> None:
        super().on_reward(traj_id, reward)
        if reward is None:
            self.dropped.add(self.group_of[traj_id])
        if self.streamed:
            self.ledger.on_reward(traj_id, reward)
        self.rewards[traj_id] = reward

    def holds_work(self) -> bool:
        return self.streamed and self.ledger.config.pack_ready_work

    def hold_work(self) -> None:
        if self.holds_work():
            self.ledger.hold()

    def release_work(self) -> None:
        if self.streamed:
            self.ledger.release()

    def close(self) -> BatchOutcome:
        if self.streamed:
            result = self.ledger.close_batch()
        else:
            order = [tid for g, members in self.plan if g not in self.dropped for tid in members]
            owner = [self.owners.owner[t] for t in order]
            trajs, rewards = [self.trajs[t] for t in order], _kept_rewards(self.rewards, order)
            if _rl(self.learner).needs_old_logprobs:
                z, _ = ppo_gradient(self.learner, trajs, rewards, owner)
                skipped = 0
            else:
                z, ran = grpo_gradient(self.learner, trajs, rewards, owner)
                skipped = sum(1 for d in owner if d == self.learner.pgs.data_unit) - len(ran)
            result = BatchResult(normaliser=z, num_kept_groups=len(self.plan) - len(self.dropped),
                                 num_dropped_groups=len(self.dropped), num_kept_trajectories=len(order),
                                 peak_buffers=1, num_skipped=skipped)
        return BatchOutcome(**asdict(result), backward_after_last_reward=self._left_after_last_reward())


def grpo_gradient(learner: MegatronLearner, batch: Sequence[Trajectory], rewards: Sequence[float],
                  owner: Sequence[int] | None = None) -> tuple[float, list[int]]:
    """GRPO's batch-synchronous gradient: every reward known; this rank's kept trajectories (all
    when ``owner`` is None) in one schedule call, packed into micro-batches of up to
    ``learner.pack_tokens`` tokens (``megathunder.learner.micro_batches``); the unnormalised sum, then
    one division by Z (the functions the ledger and the plain reference use). Returns Z and the
    indices of this rank's trajectories. Then ``step``."""
    advantages, z = batch_advantages(batch, rewards, _rl(learner))
    mine = _reward_terms(learner, batch, advantages, owner)
    learner.gradients.live.div_(z)
    return z, mine


def ppo_gradient(learner: MegatronLearner, batch: Sequence[Trajectory], rewards: Sequence[float],
                 owner: Sequence[int] | None = None) -> tuple[float, int]:
    """PPO epochs and mini-batches (``megathunder.objectives.ppo``): advantages over the whole batch,
    this rank's old logprobs fixed once, then one optimizer step per mini-batch but the last, whose
    gradient (divided by its own Z) is left in DDP's buffers for ``step`` -- which advances the
    learning-rate schedule once for the batch. Returns the batch's Z and this rank's backward passes."""
    objective = _rl(learner)
    advantages, z = batch_advantages(batch, rewards, objective)
    kept = [i for i, a in enumerate(advantages) if a is not None]
    old = _old_logprobs(learner, batch, [i for i in kept if owner is None or owner[i] == learner.pgs.data_unit])
    passes = 0
    for k, chunk in enumerate(update_plan(kept, objective)):
        if k:
            learner.step(advance_schedule=False)
        members = set(chunk)
        in_chunk = [a if i in members else None for i, a in enumerate(advantages)]
        passes += len(_reward_terms(learner, batch, in_chunk, owner, old))
        learner.gradients.live.div_(normaliser([num_loss_tokens(batch[i], objective) for i in chunk], objective))
    return z, passes


def _old_logprobs(learner: MegatronLearner, batch: Sequence[Trajectory],
                  mine: Sequence[int]) -> dict[int, torch.Tensor] | None:
    """The PPO ratio's denominator for this rank's kept trajectories (``objective.ppo_old_logprobs``),
    on the last pipeline stage (None elsewhere: only it evaluates the loss)."""
    if _rl(learner).ppo_old_logprobs == "rollout":
        missing = [batch[i].traj_id for i in mine if batch[i].rollout_logprobs is None]
        if missing:
            raise ValueError(f"objective.ppo_old_logprobs: rollout, but trajectories {missing[:5]} carry no "
                             "engine logprobs")
        return {i: batch[i].rollout_logprobs for i in mine}
    logps = learner.token_logprobs([batch[i] for i in mine])
    return None if logps is None else dict(zip(mine, logps, strict=True))


def _reward_terms(learner: MegatronLearner, batch: Sequence[Trajectory], advantages: Sequence[float | None],
                  owner: Sequence[int] | None, old: Mapping[int, torch.Tensor] | None = None) -> list[int]:
    """This rank's kept trajectories' unnormalised loss gradients in DDP's buffers (zeroed first),
    the micro-batches of one schedule call (the ledger backend's ``backward_sum``); returns their
    indices: those with advantage 0 and no reward-free term left out (``objective.
    skip_zero_advantage``: their gradient is exactly 0). ``old``: the PPO ratio's old logprobs by
    batch index (default: the current ones, ratio 1)."""
    objective = _rl(learner)
    reward_free = objective.has_reward_free_terms or learner.router_losses
    skip = objective.skip_zero_advantage and not reward_free  # a gradient of exactly 0 runs nothing
    mine = [i for i, a in enumerate(advantages)
            if a is not None and (owner is None or owner[i] == learner.pgs.data_unit) and not (skip and a == 0.0)]
    if not mine:
        learner.gradients.zero_()
        return mine
    specs = [LossSpec(advantage=advantages[i], reward_free=reward_free) for i in mine]
    learner.backend.backward_sum([batch[i] for i in mine], specs, None if old is None else [old[i] for i in mine])
    return mine


# ---------------------------------------------------------------------- OPD


class OPDBatch(Batch):
    """On-policy distillation: each turn's gradient as it is generated (``opd_streamer``), or
    ``opd_gradient`` on whole trajectories at close.

    Why the two are equal: the loss is sum_i sum_{t trained} c_it l_it / Z with c_it = beta (l_it -
    l^T_it) detached. c_it depends only on the tokens up to t and the current weights -- fixed the
    moment the turn containing t is generated, since there is one optimizer step per batch. So
    grad L = (1/Z) sum_i sum_k G_ik with G_ik turn k's terms (paths through the prefix K/V
    included), a plain sum computed in any order; Z (trained tokens or trajectories of the whole
    batch, every DP rank) is applied once at close. Rewards are logged, not trained on.
    """

    def __init__(self, learner: MegatronLearner, teacher: CachedTeacher, plan: BatchPlan, streamed: bool,
                 into: GradBuffer | None = None) -> None:
        super().__init__(learner, plan, streamed)
        self.teacher = teacher
        self.fed: dict[int, int] = {}  # streamed: tokens of each own trajectory given to the streamer
        self.mine: list[Trajectory] = []  # at the end: this rank's trajectories, in finish order
        self.num_trajectories = 0
        self.streamer = opd_streamer(learner, teacher, into) if streamed else None

    def passes(self) -> int:
        return self.streamer.stats["backward_calls"] if self.streamer is not None else len(self.mine)

    def on_turn(self, traj_id: int, tokens: list[int], start: int, end: int,
                logprobs: list[float] | None = None) -> None:
        if self.streamer is None or start == end or not self.owners.claim(traj_id, end - start):
            return
        if traj_id not in self.fed:
            self.streamer.begin_trajectory(traj_id, tokens[:start])
        else:  # tool output and template glue since the last turn: context only
            self.streamer.on_tool_output(traj_id, tokens[self.fed[traj_id] : start])
        self.streamer.on_turn(traj_id, tokens[start:end])
        self.fed[traj_id] = end

    def on_finished(self, traj: Trajectory) -> None:
        self.num_trajectories += 1
        if self.streamer is not None:
            if self.fed.pop(traj.traj_id, None) is not None:
                self.streamer.end_trajectory(traj.traj_id)  # kv_adjoint: its reverse sweep
        elif traj.loss_mask.any() and self.owners.claim(traj.traj_id, int(traj.loss_mask.sum())):
            self.mine.append(traj)

    def close(self) -> BatchOutcome:
        if self.streamer is not None:
            totals = finish_opd_stream(self.learner, self.streamer)
        else:
            totals = opd_gradient(self.learner, self.mine, self.teacher)
        return BatchOutcome(normaliser=totals.normaliser, num_kept_groups=len(self.plan), num_dropped_groups=0,
                            num_kept_trajectories=self.num_trajectories, peak_buffers=1,
                            backward_after_last_reward=self._left_after_last_reward(),
                            divergence=totals.divergence_mean)


def opd_streamer(learner: MegatronLearner, teacher: CachedTeacher, into: GradBuffer | None = None) -> TurnStreamer:
    """Per-turn OPD on ``learner`` (``objective.strategy``): gradients accumulate, unnormalised, in DDP's
    buffers (zeroed here); ``finish_opd_stream`` divides by Z once. ``into``: a buffer
    (``learner.gradients.zeros()``) each backward pass is moved into instead -- opd_grpo, whose ledger uses
    DDP's buffers as scratch."""
    opd = _distill(learner)
    learner.gradients.zero_()
    seg = learner.segments()
    model = seg if into is None else IntoAccumulator(seg, learner.gradients.live, into)
    return TurnStreamer(model, teacher, beta=opd.beta, strategy=opd.strategy, aggregation=opd.aggregation,
                        divergence=opd.divergence, jsd_lam=opd.jsd_lam, max_cached=opd.max_cached_trajectories)


def finish_opd_stream(learner: MegatronLearner, streamer: TurnStreamer) -> OPDTotals:
    """Divide the streamed OPD gradient by the batch's Z, counted over every data-parallel rank's
    trajectories (each rank streams only its own). Then ``step``."""
    totals = _opd_totals(learner, streamer.finished_counts, streamer.divergence_sum, streamer.aggregation)
    streamer.finish_batch(totals.normaliser)
    return totals


def opd_gradient(learner: MegatronLearner, batch: Sequence[Trajectory], teacher: CachedTeacher) -> OPDTotals:
    """OPD's batch-synchronous reference on this rank's trajectories (``loss_mask`` = trained
    tokens): the teacher scores each whole trajectory, one student forward and backward each, then
    one division by the batch's Z -- the gradient the streamer computes turn by turn. Then ``step``."""
    opd = _distill(learner)
    gjsd = opd.divergence == "gjsd"
    items = []
    for traj in batch:
        score = teacher.score_log_softmax if gjsd else teacher.score
        items.append((traj.tokens, traj.loss_mask, score(traj.traj_id, traj.tokens, 1)))
        teacher.release(traj.traj_id)
    learner.gradients.zero_()
    seg = learner.segments()
    if gjsd:
        counts, divergence = accumulate_full_trajectory_gjsd(seg, items, opd.beta, opd.jsd_lam)
    else:
        counts, divergence = accumulate_full_trajectory_opd(seg, items, opd.beta)
    totals = _opd_totals(learner, counts, divergence, opd.aggregation)
    seg.divide_grads(totals.normaliser)
    return totals


def _opd_totals(learner: MegatronLearner, counts: Sequence[int], divergence_sum: float,
                aggregation: OPDAggregation) -> OPDTotals:
    """Z and the mean divergence of the whole batch: this rank's counts summed over the DP group."""
    totals = torch.tensor([sum(counts), len(counts), divergence_sum], dtype=torch.float64, device=learner.pgs.device)
    if learner.pgs.dims.dp > 1:
        dist.all_reduce(totals, group=learner.pgs.dp)
    num_tokens, num_trajs = int(totals[0]), int(totals[1])
    z = opd_normaliser([num_tokens] if aggregation == "token_mean" else [0] * num_trajs, aggregation)
    return OPDTotals(z, float(totals[2]) / max(num_tokens, 1))


# ---------------------------------------------------------------------- OPD + GRPO


class OPDGRPOBatch(OPDBatch):
    """``objective.kind: opd_grpo``: OPD's per-token KL term plus the reward term, one Z::

        streamed  turns -> the per-turn streamer as for OPD, each backward moved into its own buffer
                  ``kl``; finish and reward events -> the gradient ledger (group slots); at close
                  grad = P / Z + KL / Z, Z the ledger's (the objective's normaliser, every DP rank)
        at_end    ``opd_grpo_gradient``: both parts on whole trajectories, one Z

    A trajectory has one owner for both parts: claimed at its first streamed turn, else at its
    finish; every other rank's ledger counts it through ``on_remote_finished``.
    """

    def __init__(self, learner: MegatronLearner, teacher: CachedTeacher, plan: BatchPlan, streamed: bool) -> None:
        self.kl = learner.gradients.zeros() if streamed else None
        super().__init__(learner, teacher, plan, streamed, into=self.kl)
        self.ledger = _ledger(learner)
        self.trajs: dict[int, Trajectory] = {}  # at the end: every trajectory (Z counts them all)
        self.rewards: dict[int, float | None] = {}
        if streamed:
            self.ledger.begin_batch(plan)

    def passes(self) -> int:
        if self.streamer is None:
            return 2 * sum(self.owners.is_mine(t) for t in self.trajs)  # a reward and a KL pass each
        return self.streamer.stats["backward_calls"] + self._schedule_passes()

    def on_finished(self, traj: Trajectory) -> None:
        self.num_trajectories += 1
        tid = traj.traj_id
        mine = self.owners.settle(tid, int(traj.loss_mask.sum()))
        if self.streamer is None:
            self.trajs[tid] = traj
        elif mine:
            if self.fed.pop(tid, None) is not None:
                self.streamer.end_trajectory(tid)
            self.ledger.on_finished(traj)
        else:
            self.ledger.on_remote_finished(tid, self.learner.num_loss_tokens(traj))

    def on_reward(self, traj_id: int, reward: float | None) -> None:
        super().on_reward(traj_id, reward)
        if self.streamer is not None:
            self.ledger.on_reward(traj_id, reward)
        self.rewards[traj_id] = reward

    def holds_work(self) -> bool:
        return self.streamer is not None and self.ledger.config.pack_ready_work

    def hold_work(self) -> None:
        if self.holds_work():
            self.ledger.hold()

    def release_work(self) -> None:
        if self.streamer is not None:
            self.ledger.release()

    def close(self) -> BatchOutcome:
        if self.streamer is not None:
            assert self.kl is not None  # streamed
            closed = self.ledger.close_batch()
            divergence = finish_opd_grpo_stream(self.learner, self.streamer, self.kl, closed.normaliser)
            result = BatchResult(**{**asdict(closed), "peak_buffers": closed.peak_buffers + 1,
                                    "peak_device_bytes": closed.peak_device_bytes + self.kl.nbytes})
        else:
            order = [tid for _, members in self.plan for tid in members]
            totals = opd_grpo_gradient(self.learner, [self.trajs[t] for t in order], _kept_rewards(self.rewards, order),
                                       [self.owners.owner[t] for t in order], self.teacher)
            divergence = totals.divergence_mean
            result = BatchResult(normaliser=totals.normaliser, num_kept_groups=len(self.plan), num_dropped_groups=0,
                                 num_kept_trajectories=len(order), peak_buffers=1)
        return BatchOutcome(**asdict(result), backward_after_last_reward=self._left_after_last_reward(),
                            divergence=divergence)


def finish_opd_grpo_stream(learner: MegatronLearner, streamer: TurnStreamer, kl: GradBuffer, z: float) -> float:
    """opd_grpo streamed, after ``ledger.close_batch`` (DDP's buffers = P / Z): add the streamed KL
    sum ``kl`` with the same Z, once -- grad = (P + KL) / Z. Returns the mean divergence. Then ``step``."""
    learner.gradients.live.add_(kl, alpha=1.0 / z)
    totals = _opd_totals(learner, streamer.finished_counts, streamer.divergence_sum, streamer.aggregation)
    streamer.reset_counts()
    return totals.divergence_mean


def opd_grpo_gradient(learner: MegatronLearner, batch: Sequence[Trajectory], rewards: Sequence[float],
                      owner: Sequence[int], teacher: CachedTeacher) -> OPDTotals:
    """opd_grpo's batch-synchronous reference: on this rank's trajectories the reward terms
    (``grpo_gradient``'s schedule call) and the KL terms (``opd_gradient``'s full-trajectory
    passes), unnormalised, then one division by the objective's Z (``batch_advantages``: trained
    tokens or trajectories of the whole batch). Then ``step``."""
    opd = _distill(learner)
    advantages, z = batch_advantages(batch, rewards, _rl(learner))
    mine = _reward_terms(learner, batch, advantages, owner)
    items = []
    for traj in (batch[i] for i in mine if batch[i].loss_mask.any()):
        items.append((traj.tokens, traj.loss_mask, teacher.score(traj.traj_id, traj.tokens, 1)))
        teacher.release(traj.traj_id)
    counts, divergence = accumulate_full_trajectory_opd(learner.segments(), items, opd.beta)
    learner.gradients.live.div_(z)
    return OPDTotals(z, _opd_totals(learner, counts, divergence, opd.aggregation).divergence_mean)


# ---------------------------------------------------------------------- SFT


def sft_gradient(learner: MegatronLearner, batch: Sequence[Trajectory]) -> float:
    """The supervised warm start's gradient: token-mean cross-entropy over ``batch``'s trained
    targets (``loss_mask``), each DP unit its share of the trajectories (an expert grid may span DP
    ranks), left in DDP's buffers. Returns this rank's share of the mean loss. Then ``step``.

    One schedule call, one trajectory a row (the demonstrations are trained as they come, no
    shared prefixes); the cross-entropy only, so MoE router losses weigh 0."""
    pgs = learner.pgs
    num_tokens = sum(int(t.loss_mask.sum()) for t in batch)
    mine = list(batch[pgs.data_unit :: pgs.dims.data_units])
    learner.gradients.zero_()
    if not mine:
        return 0.0

    def loss(_ks: Sequence[int], logp: torch.Tensor, _entropy: torch.Tensor | None) -> torch.Tensor:
        return -logp.sum() / num_tokens  # logp: at the micro-batch's loss targets

    passes = learner.forward_backward.backward(mine, loss, router_weights=[0.0] * len(mine), share_prefixes=False)
    if not pgs.is_last_stage:
        return 0.0
    total = -sum(float((report["logp"].cpu() * t.loss_mask).sum()) for report, t in zip(passes.reports, mine))
    return total / max(num_tokens, 1)
