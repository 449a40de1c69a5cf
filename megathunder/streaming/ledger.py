"""The gradient ledger: ThunderSyncRL's exact per-trajectory gradient streaming for the GRPO family.

Why streaming is exact
----------------------
With one optimizer step per batch the policy ratio is 1 where the gradient is taken, so every
surrogate's score gradient is ``-A_i * h_i`` with ``h_i = grad loss_i(A=-1)`` a function of
trajectory i alone (``megathunder.objectives.loss``). The batch gradient is therefore linear in the
advantages:

    grad L = (1/Z) * sum_i ( -A_i h_i + keep_g q_i ),      A_i = c_g (r_i - mu_g) / d

(``q_i``: KL/entropy terms, reward-free; ``c_g``, ``mu_g``: group scalars; ``d``: batch divisor,
1 unless batch_std). Only scalars are unknown before a group closes, so per open group we keep

    S_g = sum_{i processed} h_i ,   R_g = sum_{i processed} (r_i - b_g) h_i

with ``b_g`` the first reward processed in the group (a shift: it leaves the sum unchanged and
keeps large-offset rewards well conditioned). Because ``sum (r_i - mu) h_i = R - (mu - b) S``:

    on group close:  P += -c_g * R_g + c_g (mu_g - b_g) * S_g        (then S_g, R_g are freed)

When ``c_g`` does not depend on the rewards (Dr.GRPO, RLOO, batch_std) the R-part has a known
coefficient the moment r_i arrives and goes straight to the accumulator: one buffer per group.
The first processed trajectory has r_i - b_g = 0, so R_g is allocated only at the second one.
Once a group is closed its remaining trajectories' A_i are known and go to P directly, with q_i
fused into the same backward. At batch close ``grad = (P + P_A / d) / Z`` -- one normalisation,
with Z computed by the same function as the reference from integers.

DAPO dynamic sampling drops a group iff all its rewards are equal, i.e. iff every r_i - b_g is 0:
nothing of a group that is later dropped ever reaches P (its q_i wait until the group is known
to be kept: two distinct rewards seen, or closed), and its slot buffers are discarded.
A failed trajectory (reward ``None``) drops its whole group; with ``hold_groups_until_close``
nothing of any group reaches P before its last reward (the R-part of std-free variants waits in
R_g too), so a group can be dropped up to that moment and the update is exactly the
batch-synchronous update on the groups kept. A dropped group may be replaced by a new one
declared while the batch is open (``add_group``: DAPO's refill): no quantity of the groups already
in the batch depends on how many groups it has before it closes (Z and d are taken at close), so
the update is the batch update on the final set of kept groups, in the order they were declared.

Gradients before the reward (``LedgerConfig.max_pending``): h_i is a function of trajectory i
alone -- its tokens, masks and logprobs, known when it finishes -- and not of r_i, so it may be
computed at finish, while the verifier runs, and kept in a *pending* buffer pend_i = h_i. When the
reward arrives the reward-time path would run that same backward and apply one of three linear
maps to its result; the ledger applies the same map to pend_i instead:

    group holds a slot:   S_g += pend_i,  R_g += (r_i - b_g) pend_i   (std-free: sink += -c_g (r_i - b_g) pend_i)
    group closed, kept:   sink += -A_i pend_i                         (the direct-mode backward's -A_i h_i)
    group dropped:        pend_i is discarded                         (the reward-time path runs nothing)

A trajectory whose group waits for a slot, or whose work is held, keeps pend_i until the path
above would run its backward, and then uses it. So every term of ``grad L`` gets the coefficient
it gets without pending buffers, the backward only moved earlier; sums are reassociated, nothing
else (in fp64 to 1e-10, not bitwise: autograd's ``grad loss_i(A)`` and ``-A * h_i`` round
differently). q_i: when the group is known kept at finish (no DAPO, no hold, or two distinct
rewards seen), q_i runs in the same forward as the pending h_i, as it would with the score; when
the keep flag is still undecided q_i waits, as today, and runs in a pass of its own once the
group is known kept (at the latest in the closing group's packed ``backward_sum``) -- one more
forward per trajectory for DAPO / hold groups with reward-free terms, the price of never
letting q_i reach P for a group that may be dropped. Pending buffers are slot-kind buffers (the
slots' dtype and placement, one pool) and share ``slot_budget_gb``: K slots at their largest are
reserved first, pending buffers get the rest (``pending_within_budget``), so the two together
never exceed the budget. A trajectory that finds no pending buffer free takes the reward-time
path; only a trajectory whose reward is still out takes a pending buffer (one whose finish was
held until after its reward goes the reward-time way, where closing groups are packed).
Finish-time backwards each need their own gradient, so ``backward_sum`` (which only sums) cannot
take them; several ready at once go in one ``backward_each`` call (Packed own gradients, below).

Per-turn score gradients (``LedgerConfig.per_turn_scores``, ``megathunder.streaming.grpo_turns``):
h_i is a sum over the trajectory's model turns, so it can be accumulated into pend_i turn by turn,
before the trajectory even finishes. ``begin_turns`` takes the pending buffer at the first turn
(the same budget and count as above; none free: the trajectory takes the finish-time path),
``turn_buffer`` is where each turn's part goes (None once its group was dropped: a failed
groupmate), ``drop_turns`` gives it back when the turns streamed do not make up the loss mask.
At ``on_finished`` a buffer so filled is pend_i, and everything above applies unchanged.

Zero advantages (``RLObjective.skip_zero_advantage``): a group whose rewards are all equal has
A_i = 0 for every member, and -0 * h_i adds an exact 0 to P; with no reward-free term due, such a
trajectory runs nothing once its group is closed (a pending h_i of it is dropped). A slot pass,
though, runs before A_i is known: with ``LedgerConfig.defer_uniform_groups`` an open group takes
a slot only once two of its rewards differ (every rank sees every reward, so every rank agrees);
until then its trajectories wait as for a slot, and at the first differing reward the waiting ones
go first, so b_g is their common reward and they write S_g alone. A group that closes uniform then
runs nothing at all. Only when passes run changes (docs/exactness.md, section 2.12).

Packed own gradients (a backend with ``backward_each``): when several trajectories become ready
at once -- a slot handed to a waiting group with several rewards in, held work released, a group
seen kept -- those whose work is a pass of their own (a slot's S and R, a pending h_i) need each
its own gradient, so ``backward_sum`` cannot pack them; ``backward_each`` runs them in one call
(on a pipelined learner one schedule call, each a micro-batch) and hands each gradient back on its
own. Each trajectory's plan (the slot or pending buffer it takes, its specs) is made before the
call in the members' order, and what one plan decides is what the next one's reads (slots and
pending buffers in use, counted when taken), so every trajectory takes the path it takes one at a
time; the gradients are applied in the same order, each element for element the gradient its own
call gives. The update is therefore bitwise the one-at-a-time update; a member with a pending h_i
(a fold, no pass) ends the run so its fold keeps its place in the order.

Memory: at most K slots (``LedgerConfig.max_group_slots``, lowered to what fits in
``slot_budget_gb``), each 2 parameter-sized buffers (1 for std-free variants), plus P (plus P_A for
batch_std): 2K + 1. Groups that find no free slot wait (their trajectories are kept as data, not
gradients) and stream directly once closed. K = 0 is group-level streaming, K = None
per-trajectory streaming for every group. Plus at most ``max_pending`` pending buffers in force.
Slot buffers may be bf16 and/or in host memory
(``megathunder.streaming.buffers``: the same update for either placement; bf16's error bound in
docs/exactness.md, section 2.7); P and P_A stay in the gradient's dtype on its device.

Data parallel: each rank sees every reward and every trajectory's loss-token count, but runs
backward only for its own (local) trajectories. Group scalars and Z are then identical on every
rank, and the data-parallel sum of the ranks' P equals the global P exactly.

Floating point: the scalars (mu, std, c_g, d, Z) are computed by the reference's own functions
over rewards in sample order, so they are bitwise identical; only the vector sums are reassociated.
With K = 0, events in sample order and ``reward_free_terms=with_score`` the ledger performs the
reference's operations in the reference's order and is bitwise equal to it.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megathunder.config import LedgerConfig, RLObjective
from megathunder.objectives import (
    GroupStats,
    LossSpec,
    advantage,
    batch_divisor,
    coef_known_before_close,
    group_stats,
    keeps_group,
    normaliser,
    num_loss_tokens,
    size_coef,
)
from megathunder.streaming.buffers import (
    BufferPool,
    GradBuffer,
    GradientBackend,
    pending_within_budget,
    slots_within_budget,
)
from megathunder.trajectory import Trajectory


class LedgerError(ValueError):
    """An event that does not fit the batch; the ledger's state is unchanged when it is raised."""


@dataclass
class _Traj:
    traj_id: int
    group: _Group
    data: Trajectory | None = None  # set on the rank that owns the trajectory
    num_loss_tokens: int | None = None  # set when it finishes (on every rank)
    reward: float | None = None
    has_reward: bool = False  # False until its reward event (whose reward may be None: failed)
    score_done: bool = False
    reward_free_done: bool = False
    pend: GradBuffer | None = None  # h_i computed at finish (or turn by turn), waiting for the reward's fold

    @property
    def finished_tokens(self) -> int:
        """The loss-token count of a trajectory known to have finished."""
        assert self.num_loss_tokens is not None, f"internal: trajectory {self.traj_id} has not finished"
        return self.num_loss_tokens

    @property
    def known_reward(self) -> float:
        """The reward of a trajectory known to have one (it arrived and did not fail)."""
        assert self.reward is not None, f"internal: trajectory {self.traj_id} has no reward"
        return self.reward


@dataclass
class _Slot:
    shift: float = 0.0
    S: GradBuffer | None = None
    R: GradBuffer | None = None
    num_processed: int = 0


@dataclass
class _Group:
    group_id: int
    members: list[_Traj] = field(default_factory=list)
    num_rewards: int = 0
    stats: GroupStats | None = None  # set when the group closes
    keep: bool | None = None  # None until decided (DAPO)
    slot: _Slot | None = None
    waiting_for_slot: bool = False
    failed: bool = False  # a trajectory failed: the group leaves the batch at close
    distinct: bool = False  # two of its rewards differ (every rank sees every reward)

    @property
    def closed(self) -> bool:
        return self.stats is not None

    @property
    def closed_stats(self) -> GroupStats:
        """The group scalars of a group known to be closed."""
        assert self.stats is not None, f"internal: group {self.group_id} is still open"
        return self.stats


@dataclass(frozen=True)
class BatchResult:
    normaliser: float
    num_kept_groups: int
    num_dropped_groups: int
    num_kept_trajectories: int
    peak_buffers: int
    peak_device_bytes: int = 0  # the ledger's buffers at their peak (incl. a host slot's staging)
    peak_host_bytes: int = 0
    max_group_slots: int | None = None  # K in force (ledger.max_group_slots within slot_budget_gb)
    peak_pending: int = 0  # pending h_i buffers at their peak (counted in peak_buffers too)
    max_pending: int | None = 0  # pending buffers allowed (ledger.max_pending within the budget's rest)
    num_pending_backward: int = 0  # trajectories whose score backward ran at finish (pending)
    num_turn_scores: int = 0  # trajectories whose h_i was computed turn by turn (ledger.per_turn_scores)
    num_skipped: int = 0  # trajectories whose advantage was 0 and nothing due: no pass (objective.skip_zero_advantage)


class GradientLedger:
    def __init__(
        self,
        backend: GradientBackend,
        objective: RLObjective,
        config: LedgerConfig | None = None,
        *,
        reward_shift: bool = True,
        model_reward_free: bool = False,
        dp_group: dist.ProcessGroup | None = None,
        dp_copies: int = 1,
    ) -> None:
        """``reward_shift=False`` exists only to demonstrate why the shift b_g is needed.
        ``model_reward_free``: the backend's model adds reward-free terms of its own to every
        reward-free pass (MoE router losses, ``megathunder.learner.router_losses``), so q_i exists
        even when the objective has no KL or entropy term. ``dp_group``: under data parallelism,
        the ranks whose ledgers split the batch's trajectories (each trajectory owned by one of them,
        or by ``dp_copies`` of them that run it together: an expert grid's data unit); Z is then
        cross-checked at close (``close_batch``).

        The objective must be an ``RLObjective`` (GRPO and its variants: the ledger streams its
        score term) and the backend's own objective, if it has one, the same: a backend computing
        another loss than the ledger's coefficients assume gives a wrong gradient, not an error."""
        if not isinstance(objective, RLObjective):
            raise LedgerError(f"GradientLedger: objective.kind={getattr(objective, 'kind', type(objective).__name__)} "
                              "has no reward part to stream; the ledger takes an RLObjective (GRPO and its variants)")
        own = getattr(backend, "objective", None)
        if own is not None and own != objective:
            changed = sorted(k for k in type(objective).model_fields if getattr(own, k, None) != getattr(objective, k))
            raise LedgerError(f"GradientLedger: the backend computes the loss of another objective than the ledger's "
                              f"(they differ in {', '.join(changed) or 'kind'}); build both with the same one")
        if dp_copies < 1:
            raise ValueError(f"dp_copies: {dp_copies} < 1")
        self.dp_group, self.dp_copies = dp_group, dp_copies
        self.backend = backend
        self.objective = objective
        self.config = config or LedgerConfig()
        self.reward_shift = reward_shift
        self.pool = BufferPool(backend, self.config.slot_dtype, self.config.slot_placement,
                               self.config.host_threads, self.config.host_chunk_mb)
        self._hold = self.config.hold_groups_until_close
        self._std_free = coef_known_before_close(objective) and not self._hold
        self._has_reward_free = objective.has_reward_free_terms or model_reward_free
        self._skip_zero = objective.skip_zero_advantage
        # Deferring pays only where a uniform group's passes are then skipped; else it delays them.
        self._defer = self.config.defer_uniform_groups and self._skip_zero and not self._has_reward_free
        self._groups: dict[int, _Group] = {}
        self._trajs: dict[int, _Traj] = {}
        self._order: list[_Traj] = []  # sample order
        self._P: GradBuffer | None = None
        self._PA: GradBuffer | None = None  # score terms awaiting the batch divisor (batch_std)
        self._num_slots_used = 0
        self.max_slots = self.config.max_group_slots  # K in force; the budget is applied in begin_batch
        self.max_pending = self.config.max_pending  # pending buffers allowed; likewise
        self._num_pending = 0
        self._peak_pending = 0
        self._num_pending_backward = 0
        self._num_turn_scores = 0
        self._num_skipped = 0
        self.events: list[tuple[float, str, int]] = []  # (time, kind, id) for timelines
        self._held: list[_Traj] | None = None  # work held back for one packed call (``hold``)

    # ------------------------------------------------------------------ events

    def begin_batch(self, groups: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Declare the batch: ``[(group_id, [traj_id, ...]), ...]`` in sample order."""
        if self._P is not None:
            raise LedgerError("begin_batch: the previous batch is still open")
        self._check_new_groups("begin_batch", groups, set(), set())
        self._groups, self._trajs, self._order = {}, {}, []
        self._declare(groups)
        self.pool.reset_peak()
        self._P = self.pool.acquire()
        if self.objective.advantage == "batch_std":
            self._PA = self.pool.acquire()
        self.max_slots = slots_within_budget(self.config.max_group_slots, self.config.slot_budget_gb,
                                             self.pool.slot_bytes(self._P), self.buffers_per_slot)
        self.max_pending = pending_within_budget(self.config.max_pending, self.max_slots, self.config.slot_budget_gb,
                                                 self.pool.slot_bytes(self._P), self.buffers_per_slot)
        self._num_slots_used = 0
        self._num_pending = self._peak_pending = self._num_pending_backward = self._num_turn_scores = 0
        self._num_skipped = 0
        self.events = []
        self._log("begin_batch", -1)

    def add_group(self, group_id: int, members: Sequence[int]) -> None:
        """One more group joins the open batch, after the groups declared so far in sample order
        (DAPO's refill: a new group replaces one that was dropped; ``batch.max_refill_groups``).

        Exact: nothing declared earlier depends on the batch's size before it closes -- a group's
        scalars are its own, and Z, the batch divisor and K's slots are taken at close or on demand --
        so a batch grown this way gives the update of the batch declared with all its groups at once."""
        if self._P is None:
            raise LedgerError(f"add_group {group_id}: no batch is open")
        self._check_new_groups("add_group", [(group_id, members)], set(self._groups), set(self._trajs))
        self._declare([(group_id, members)])
        self._log("group_added", group_id)

    def on_finished(self, traj: Trajectory) -> None:
        """A trajectory owned by this rank finished generating."""
        t = self._lookup(traj.traj_id, "finished")
        if t.num_loss_tokens is not None:
            raise LedgerError(f"trajectory {traj.traj_id}: finished twice")
        if traj.group_id != t.group.group_id:
            raise LedgerError(
                f"trajectory {traj.traj_id}: finished with group_id {traj.group_id}, "
                f"but the batch places it in group {t.group.group_id}"
            )
        t.data = traj
        t.num_loss_tokens = num_loss_tokens(traj, self.objective)
        if t.pend is not None:  # accumulated turn by turn: it is h_i now
            self._num_turn_scores += 1
        self._log("finished", traj.traj_id)
        self._advance(t)

    def begin_turns(self, traj_id: int) -> GradBuffer | None:
        """A pending buffer for a trajectory that has not finished, its h_i to be accumulated turn
        by turn (zeroed; slot kind); None when none is free or its group was dropped."""
        t = self._lookup(traj_id, "turn")
        if t.num_loss_tokens is not None or t.pend is not None:
            raise LedgerError(f"trajectory {traj_id}: begin_turns after its finish or a second time")
        if t.group.failed or not self._pending_free():
            return None
        self._take_pending(t)
        self._log("pending:turns", traj_id)
        return t.pend

    def turn_buffer(self, traj_id: int) -> GradBuffer | None:
        """The buffer ``begin_turns`` gave, while the ledger still holds it for the trajectory."""
        return self._lookup(traj_id, "turn").pend

    def drop_turns(self, traj_id: int) -> None:
        """Give back a trajectory's turn buffer before its finish: its turns did not make up its
        loss mask, so its h_i comes from the finish- or reward-time path instead."""
        t = self._lookup(traj_id, "turn")
        if t.num_loss_tokens is not None:
            raise LedgerError(f"trajectory {traj_id}: drop_turns after its finish")
        self._discard_pending(t)

    def on_remote_finished(self, traj_id: int, num_loss_tokens: int) -> None:
        """A trajectory owned by another data-parallel rank finished (its size counts in Z)."""
        t = self._lookup(traj_id, "finished")
        if t.num_loss_tokens is not None:
            raise LedgerError(f"trajectory {traj_id}: finished twice")
        if num_loss_tokens < 0:
            raise LedgerError(f"trajectory {traj_id}: negative loss-token count")
        t.num_loss_tokens = num_loss_tokens
        self._log("finished", traj_id)

    def on_reward(self, traj_id: int, reward: float | None) -> None:
        """``reward=None``: the trajectory failed; its group is dropped (needs
        ``hold_groups_until_close`` unless nothing of the group can have reached P yet)."""
        t = self._lookup(traj_id, "reward")
        if t.has_reward:
            raise LedgerError(f"trajectory {traj_id}: duplicate reward ({t.reward} then {reward})")
        if t.num_loss_tokens is None:
            raise LedgerError(f"trajectory {traj_id}: reward before the trajectory finished")
        g = t.group
        if reward is None:
            if not self._hold and g.keep is True:
                raise LedgerError(
                    f"trajectory {traj_id}: failed, but group {g.group_id} may already be in the "
                    "update; set ledger.hold_groups_until_close to drop groups on failure"
                )
            g.failed = True
            for m in g.members:  # the group leaves the batch: its pending gradients are worthless
                self._discard_pending(m)
        else:
            reward = _real(traj_id, reward)
        t.reward, t.has_reward = reward, True
        g.num_rewards += 1
        self._log("reward", traj_id)
        if g.num_rewards == len(g.members):
            self._close_group(g)
            return
        if g.failed or reward is None:
            return
        became_distinct = not g.distinct and any(m.reward not in (None, reward) for m in g.members)
        g.distinct = g.distinct or became_distinct
        if g.keep is None and not self._hold and became_distinct:
            g.keep = True  # two distinct rewards: the group survives dynamic sampling
            self._advance_all(g.members)
        elif self._defer and became_distinct:  # the waiting ones first: their common reward is b_g
            self._advance_all([m for m in g.members if m is not t] + [t])
        else:
            self._advance(t)

    def hold(self) -> None:
        """Hold back the backward passes that events make due, until ``release``: more events are
        queued behind this one, so the learner takes what is ready then in as few schedule calls
        as possible (ready-work packing). Exact for the same reason any event order is: an event
        only records what is known; each held trajectory's work runs at ``release`` with
        everything known by then (its group may have closed meanwhile: it goes direct instead of
        into a slot, as a trajectory that found no slot would)."""
        if self._P is None:
            raise LedgerError("hold: no batch is open")
        if self._held is None:
            self._held = []

    def release(self) -> None:
        """Run the held work: every held direct-mode trajectory (its group closed and kept), of
        whatever group, in one ``backward_sum`` (packed, pipelined); then the rest (slot writes,
        reward-free terms) in the order they were held, consecutive own-gradient passes in one
        ``backward_each`` call where the backend has it."""
        held, self._held = self._held, None
        if not held:
            return
        held = list({id(t): t for t in held}.values())
        self._direct_sum([t for t in held if t.group.closed])
        self._advance_all(held)

    def _check_counts(self, kept: Sequence[_Traj]) -> None:
        """Under data parallelism every rank's Z counts every kept trajectory's loss tokens: its own
        from the trajectory (``on_finished``), the others' as ``on_remote_finished`` was told. Summed
        over the owners, the own counts are the batch's true count; a rank told a wrong count (an
        ``int(mask.sum())`` that is not the objective's ``num_loss_tokens``) would divide by a wrong
        Z, silently. So the own counts are summed over ``dp_group`` (each unit's ``dp_copies``
        ranks count theirs alike) and every rank's total compared with it; every rank sees the same
        figures (one all-reduce of the sum, one of the extremes), so all raise or none does."""
        if self.dp_group is None:
            return
        own = float(sum(t.finished_tokens for t in kept if t.data is not None))
        total = float(sum(t.finished_tokens for t in kept))
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.dp_group) == "nccl" \
            else torch.device("cpu")
        sums = torch.tensor([own / self.dp_copies], dtype=torch.float64, device=device)
        extremes = torch.tensor([total, -total], dtype=torch.float64, device=device)
        dist.all_reduce(sums, group=self.dp_group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.dp_group)
        true, most, least = float(sums[0]), float(extremes[0]), -float(extremes[1])
        if most != true or least != true:
            raise LedgerError(
                f"close_batch: the data-parallel ranks' loss-token counts disagree: the owners' own "
                f"trajectories hold {true:g} loss tokens, while the ranks counted {least:g}..{most:g} "
                f"(this rank {total:g}); a count given to on_remote_finished is not the objective's "
                "num_loss_tokens of that trajectory")

    def close_batch(self) -> BatchResult:
        """All groups closed: normalise once and hand the gradient to the backend."""
        if self._P is None:
            raise LedgerError("close_batch: no batch is open")
        for g in self._groups.values():
            if not g.closed:
                raise LedgerError(
                    f"close_batch: group {g.group_id} is still open "
                    f"({g.num_rewards}/{len(g.members)} rewards)"
                )
        self.release()
        pending = [t.traj_id for t in self._order if t.data is not None and t.group.keep and not t.score_done]
        assert not pending, f"internal: trajectories {pending} were never processed"
        assert self._num_pending == 0, f"internal: {self._num_pending} pending gradients were never folded"
        kept = [t for t in self._order if t.group.keep]
        self._check_counts(kept)
        z = normaliser([t.finished_tokens for t in kept], self.objective)
        self.pool.sync()
        if self._PA is not None:
            centered = [t.known_reward - t.group.closed_stats.mean for t in kept]
            self._P.add_(self._PA, alpha=1.0 / batch_divisor(centered, self.objective))
        self._P.div_(z)
        self.backend.load_grad(self._P)
        self._log("batch_closed", -1)
        num_kept = sum(1 for g in self._groups.values() if g.keep)
        result = BatchResult(
            normaliser=z,
            num_kept_groups=num_kept,
            num_dropped_groups=len(self._groups) - num_kept,
            num_kept_trajectories=len(kept),
            peak_buffers=self.pool.peak_live,
            peak_device_bytes=self.pool.peak_bytes["device"],
            peak_host_bytes=self.pool.peak_bytes["host"],
            max_group_slots=self.max_slots,
            peak_pending=self._peak_pending,
            max_pending=self.max_pending,
            num_pending_backward=self._num_pending_backward,
            num_turn_scores=self._num_turn_scores,
            num_skipped=self._num_skipped,
        )
        self.pool.release([self._P, self._PA])
        self._P = self._PA = None
        return result

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _check_new_groups(what: str, groups: Sequence[tuple[int, Sequence[int]]], group_ids: set[int],
                          seen: set[int]) -> None:
        """Raise before any state changes if ``groups`` repeat a group or trajectory (of the batch so far)."""
        group_ids, seen = set(group_ids), set(seen)
        for gid, members in groups:
            if gid in group_ids:
                raise LedgerError(f"{what}: group {gid} listed twice")
            if not members:
                raise LedgerError(f"{what}: group {gid} is empty")
            group_ids.add(gid)
            for tid in members:
                if tid in seen:
                    raise LedgerError(f"{what}: trajectory {tid} listed twice")
                seen.add(tid)

    def _declare(self, groups: Sequence[tuple[int, Sequence[int]]]) -> None:
        undecided = self.objective.dapo_dynamic_sampling or self._hold
        for gid, members in groups:
            group = _Group(gid, keep=None if undecided else True)
            for tid in members:
                t = _Traj(tid, group)
                group.members.append(t)
                self._trajs[tid] = t
                self._order.append(t)
            self._groups[gid] = group

    @property
    def buffers_per_slot(self) -> int:
        """Parameter-sized buffers a slot holds at most: S and R, or S alone when std-free."""
        return 1 if self._std_free else 2

    def _lookup(self, traj_id: int, what: str) -> _Traj:
        if self._P is None:
            raise LedgerError(f"{what} for trajectory {traj_id}: no batch is open")
        t = self._trajs.get(traj_id)
        if t is None:
            raise LedgerError(f"{what} for unknown trajectory {traj_id}")
        return t

    def _log(self, kind: str, ident: int) -> None:
        self.events.append((time.perf_counter(), kind, ident))

    @property
    def _accumulator(self) -> GradBuffer:
        """P, while a batch is open."""
        assert self._P is not None, "internal: no batch is open"
        return self._P

    @property
    def _score_sink(self) -> GradBuffer:
        return self._PA if self._PA is not None else self._accumulator

    def _advance_all(self, members: Iterable[_Traj]) -> None:
        """``_advance`` each member in order. With a backend that runs several trajectories' own
        gradients in one call (``backward_each``: one schedule call, so a pipeline-parallel learner
        pipelines them instead of running each alone through the stages), consecutive members
        whose work is a pass and nothing else go in one call; their gradients are applied in the
        members' order, each exactly as its own call's would be (section "Packed own gradients"
        above). A member with a pending h_i (its fold runs no pass) ends the run: its fold goes
        after the work planned before it, as one at a time."""
        each = getattr(self.backend, "backward_each", None)
        if each is None or self._held is not None or not self.config.pack_own_passes:
            for m in members:
                self._advance(m)
            return
        run: list[tuple[_Traj, list[tuple[str, LossSpec]]]] = []
        for m in members:
            if m.pend is not None:
                self._run_each(run, each)
                run = []
                self._advance(m)
                continue
            plan = self._plan(m)
            if plan:
                run.append((m, plan))
        self._run_each(run, each)

    def _run_each(self, run: Sequence[tuple[_Traj, list[tuple[str, LossSpec]]]],
                  each: Callable[[list[tuple[Trajectory, list[LossSpec]]], Callable[[int, int, GradBuffer], None]], None],
                  ) -> None:
        """The planned passes of ``run`` in one ``backward_each`` call (one alone: ``backward``)."""
        if not run:
            return
        if len(run) == 1:
            t, plan = run[0]
            self._apply(t, plan, self.backend.backward(_data(t), [spec for _, spec in plan]))
            return
        done = [0] * len(run)

        def on_grad(k: int, j: int, grad: GradBuffer) -> None:
            t, plan = run[k]
            if j != done[k]:
                raise RuntimeError(f"backward_each: pass {j} of trajectory {t.traj_id} came before pass {done[k]}")
            self._apply_one(t, plan[j][0], grad)
            done[k] += 1
            if done[k] == len(plan):
                self._log(f"backward:{'+'.join(sink for sink, _ in plan)}", t.traj_id)

        each([(_data(t), [spec for _, spec in plan]) for t, plan in run], on_grad)
        missing = [t.traj_id for (t, plan), n in zip(run, done, strict=True) if n != len(plan)]
        if missing:
            raise RuntimeError(f"backward_each: no gradient came back for trajectories {missing}")

    def _advance_closed_group(self, g: _Group) -> None:
        """A group just closed: its waiting trajectories' A_i are known.

        With a backend that can sum several trajectories in one pass (``backward_sum``: one
        schedule call, so a pipeline-parallel learner pipelines them), every direct-mode
        trajectory of the group goes in one call; otherwise one at a time in sample order
        (the order the bitwise oracle relies on). Held (``hold``): all of it waits for ``release``.
        """
        if self._held is not None:
            self._held.extend(g.members)
            return
        self._direct_sum(g.members)
        self._advance_all(g.members)

    def _direct_sum(self, members: Sequence[_Traj]) -> None:
        """The direct-mode trajectories among ``members`` (group closed and kept, score not yet
        in), q_i fused, in one ``backward_sum`` when the backend has it and there are several. A
        member with a pending h_i is folded (no backward); its q_i, if still due, joins the sum."""
        backward_sum = getattr(self.backend, "backward_sum", None)
        batchable = [
            m for m in members
            if backward_sum is not None and m.group.keep and m.group.closed and self._PA is None
            and m.data is not None and not m.score_done
        ]
        for m in batchable:  # a pending h_i needs no backward: fold it; only its q_i may still run
            if m.pend is not None:
                self._fold_pending_direct(m)
            fuse = self._has_reward_free and not m.reward_free_done
            if (not m.score_done and not fuse and self._skip_zero
                    and advantage(m.known_reward, m.group.closed_stats) == 0.0):
                self._skip(m)
        batchable = [m for m in batchable if not m.score_done or (self._has_reward_free and not m.reward_free_done)]
        if backward_sum is not None and len(batchable) > 1:
            specs = []
            for m in batchable:
                fuse = self._has_reward_free and not m.reward_free_done
                a = None if m.score_done else advantage(m.known_reward, m.group.closed_stats)
                specs.append(LossSpec(advantage=a, reward_free=fuse))
            self._accumulator.add_(backward_sum([m.data for m in batchable], specs))
            for m in batchable:
                m.score_done = m.reward_free_done = True
            self._log("backward:direct-sum", batchable[0].group.group_id)

    def _advance(self, t: _Traj) -> None:
        """Run every part of t's gradient whose coefficient is now known, in one forward (held:
        later, at ``release``)."""
        if self._held is not None:
            self._held.append(t)
            return
        plan = self._plan(t)
        if plan:
            self._apply(t, plan, self.backend.backward(_data(t), [spec for _, spec in plan]))

    def _plan(self, t: _Traj) -> list[tuple[str, LossSpec]]:
        """What t's pass computes now: (sink, loss) pairs, in one forward. Folds of a pending h_i
        (no pass) run here; a slot, or a pending buffer for h_i, is taken here, so the next
        trajectory's plan sees it taken as it would after this one's pass."""
        g = t.group
        if t.data is None or t.num_loss_tokens is None:
            return []
        if g.keep is False or g.failed:  # dropped: nothing of it is (or will be) in the update
            self._discard_pending(t)
            t.score_done = t.reward_free_done = True
            return []
        plan: list[tuple[str, LossSpec]] = []
        if not t.score_done:
            if g.closed:
                if t.pend is not None:
                    self._fold_pending_direct(t)
                else:
                    a = advantage(t.known_reward, g.closed_stats)
                    fuse = self._has_reward_free and not t.reward_free_done and self._PA is None
                    if a == 0.0 and not fuse and self._skip_zero:
                        self._skip(t)
                    else:
                        plan.append(("direct+rf" if fuse else "direct", LossSpec(advantage=a, reward_free=fuse)))
            elif t.reward is not None and (g.distinct or not self._defer) and self._slot(g) is not None:
                if t.pend is not None:
                    self._fold_pending_into_slot(g, t)
                else:
                    plan.append(("slot", LossSpec(advantage=-1.0, reward_free=False)))
            elif t.pend is None and not t.has_reward and self._pending_free():
                self._take_pending(t)  # h_i now, its weight later
                plan.append(("pending", LossSpec(advantage=-1.0, reward_free=False)))
        wants_reward_free = self._has_reward_free and not t.reward_free_done and all(
            sink != "direct+rf" for sink, _ in plan)
        if wants_reward_free and g.keep:
            score_later = not t.score_done and not plan and t.pend is None
            if not score_later or self.config.reward_free_terms == "at_finish":
                plan.append(("rf", LossSpec(advantage=None, reward_free=True)))
        return plan

    def _apply(self, t: _Traj, plan: Sequence[tuple[str, LossSpec]], grads: Iterable[GradBuffer]) -> None:
        """t's planned gradients, in the plan's order, into their sinks."""
        for (sink, _), grad in zip(plan, grads, strict=True):
            self._apply_one(t, sink, grad)
        self._log(f"backward:{'+'.join(sink for sink, _ in plan)}", t.traj_id)

    def _apply_one(self, t: _Traj, sink: str, grad: GradBuffer) -> None:
        if sink == "slot":
            self._add_to_slot(t.group, t, grad)
            t.score_done = True
        elif sink == "pending":
            assert t.pend is not None
            self.pool.slot_write(t.pend, grad, first=True)
            self._num_pending_backward += 1
        elif sink == "rf":
            self._accumulator.add_(grad)
            t.reward_free_done = True
        else:
            self._score_sink.add_(grad)
            t.score_done = True
            t.reward_free_done = t.reward_free_done or sink == "direct+rf"

    def _slot(self, g: _Group) -> _Slot | None:
        if g.slot is None:
            limit = self.max_slots
            if limit is not None and self._num_slots_used >= limit:
                g.waiting_for_slot = True
                return None
            g.slot = _Slot()
            g.waiting_for_slot = False
            self._num_slots_used += 1
        return g.slot

    def _add_to_slot(self, g: _Group, t: _Traj, h: GradBuffer, pending: bool = False) -> None:
        """h_i into the group's slot: ``h`` the live gradient, or (``pending``) t's pending buffer."""
        slot = g.slot
        assert slot is not None and t.reward is not None
        if slot.num_processed == 0:
            slot.shift = t.reward if self.reward_shift else 0.0
            slot.S = self.pool.acquire_slot()
        assert slot.S is not None
        writes = [(slot.S, 1.0, slot.num_processed == 0)]  # (buffer, alpha, first): one staged h for all
        d = t.reward - slot.shift
        if d != 0.0:
            if self._std_free:
                # c_g is known (depends on the group size only): the R-part goes straight out.
                c = size_coef(len(g.members), self.objective)
                if pending:
                    self.pool.fold(self._score_sink, h, alpha=-c * d)
                else:
                    self._score_sink.add_(h, alpha=-c * d)
            else:
                first_r = slot.R is None
                if first_r:
                    slot.R = self.pool.acquire_slot()
                assert slot.R is not None
                writes.append((slot.R, d, first_r))
        (self.pool.slot_adds if pending else self.pool.slot_writes)(writes, h)
        slot.num_processed += 1

    # ------------------------------------------------------------------ pending gradients

    def _pending_free(self) -> bool:
        """May one more trajectory's h_i be computed now, before its weight is known?"""
        return self.max_pending is None or self._num_pending < self.max_pending

    def _take_pending(self, t: _Traj) -> GradBuffer:
        t.pend = self.pool.acquire_slot()
        self._num_pending += 1
        self._peak_pending = max(self._peak_pending, self._num_pending)
        return t.pend

    def _fold_pending_into_slot(self, g: _Group, t: _Traj) -> None:
        """S_g += pend_i, R_g += (r_i - b_g) pend_i (std-free: the R-part to the sink): the
        reward-time path's slot update, on the h_i computed at finish."""
        assert t.pend is not None
        self._add_to_slot(g, t, t.pend, pending=True)
        t.score_done = True
        self._discard_pending(t)
        self._log("fold:pending->slot", t.traj_id)

    def _fold_pending_direct(self, t: _Traj) -> None:
        """Group closed and kept: sink += -A_i pend_i, the direct-mode backward's gradient."""
        assert t.pend is not None
        a = advantage(t.known_reward, t.group.closed_stats)
        if a == 0.0 and self._skip_zero:  # -0 x pend_i: nothing to add
            self._log("drop:pending-zero-advantage", t.traj_id)
        else:
            self.pool.fold(self._score_sink, t.pend, alpha=-a)
            self._log("fold:pending->direct", t.traj_id)
        t.score_done = True
        self._discard_pending(t)

    def _discard_pending(self, t: _Traj) -> None:
        if t.pend is not None:
            self.pool.release([t.pend])
            t.pend = None
            self._num_pending -= 1
            self._log("pending:freed", t.traj_id)

    def _skip(self, t: _Traj) -> None:
        """A closed group's trajectory with A_i = 0 and no reward-free term due: its gradient is 0,
        so nothing runs (``objective.skip_zero_advantage``)."""
        t.score_done = True
        self._num_skipped += 1
        self._log("skip:zero-advantage", t.traj_id)

    def _close_group(self, g: _Group) -> None:
        if g.failed:
            g.stats, g.keep = GroupStats(mean=0.0, std=0.0, coef=0.0), False
        else:
            rewards = [m.known_reward for m in g.members]  # sample order; none failed
            g.stats = group_stats(rewards, self.objective)
            g.keep = keeps_group(rewards, self.objective)
        self._log("group_closed", g.group_id)
        slot = g.slot
        if slot is not None:
            if g.keep and slot.num_processed:
                c, delta = g.stats.coef, g.stats.mean - slot.shift
                if slot.R is not None:
                    self.pool.fold(self._score_sink, slot.R, alpha=-c)
                if delta != 0.0:
                    assert slot.S is not None  # num_processed > 0
                    self.pool.fold(self._score_sink, slot.S, alpha=c * delta)
            self.pool.release([slot.S, slot.R])
            g.slot = None
            self._num_slots_used -= 1
        g.waiting_for_slot = False
        self._advance_closed_group(g)
        if slot is not None:
            self._hand_over_slot()

    def _hand_over_slot(self) -> None:
        """Give a freed slot to the waiting open group with the most trajectories ready for it."""
        waiting = [g for g in self._groups.values() if g.waiting_for_slot and not g.closed]
        if not waiting:
            return
        def num_ready(g: _Group) -> int:
            return sum(1 for m in g.members if m.data is not None and m.reward is not None and not m.score_done)
        best = max(waiting, key=num_ready)
        self._advance_all(best.members)


def _data(t: _Traj) -> Trajectory:
    """The trajectory of a member a plan was made for (its owner has it)."""
    assert t.data is not None, f"internal: trajectory {t.traj_id} has no data on this rank"
    return t.data


def _real(traj_id: int, reward: object) -> float:
    """A reward as a finite float; anything but a real number (a bool, a string, a tensor) is refused
    rather than converted: ``float("1")`` and ``float(True)`` would both train as 1.0."""
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        hint = " (a tensor: pass .item())" if isinstance(reward, torch.Tensor) else ""
        raise LedgerError(f"trajectory {traj_id}: reward {reward!r} of type {type(reward).__name__} is not a real "
                          f"number{hint}")
    value = float(reward)
    if not math.isfinite(value):
        raise LedgerError(f"trajectory {traj_id}: non-finite reward {value}")
    return value
