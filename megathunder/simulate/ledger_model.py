"""Thunder's learner held to its ledger: who owns each trajectory, which path its gradient takes
on its rank, and what each call and buffer operation costs there.

Ownership (``megathunder.learner.batches.Ownership``). A trajectory belongs to one data-parallel
rank, the least loaded by tokens when it is first claimed: at its finish, or at its first turn's
end when per-turn scores are on. Its gradient runs on that rank only.

Paths. Every rank sees every reward, and its ledger (``megathunder.streaming.ledger``) holds at most
K slots and ``max_pending`` pending buffers of its own; a slot is taken by a group when one of the
rank's own trajectories of it needs one. Per rank, events in time order (turn ends, finishes,
rewards; ties in that order):

    first turn end   (per-turn on) a turn stream and a pending buffer free: the trajectory streams
                     by turns: each turn's share is one call, the finish's item one more
    finish           no stream, pending on and a buffer free: h_i now, one call and one write into
                     the pending buffer
    reward           (not the group's last) the group holds or takes a slot: into it -- one call and
                     its writes (S; S and R from the second trajectory on; std-free: S), or with a
                     pending h_i the same adds from it (no call); no slot free: it waits
    group's last     every rank: slot folded into P (R and S), its waiting own trajectories and the
    reward           last one go direct -- one packed call for those without a pending h_i, a fold
                     each for those with one --, then the slot goes to the waiting group with most
                     trajectories waiting, which processes them into it

Costs on a rank (``Costs``). A call costs ``call_overhead_s`` plus its work through the pipeline:
``work * (m + p - 1) / m`` for m trajectories, so a lone slot-path trajectory at PP = 2 costs twice
its work. Ready direct work is packed: the rank takes every direct job ready when it starts one
into a single call (ready-work packing); so is ready slot- and pending-path work, each trajectory's
gradient handed back on its own (``ledger.pack_own_passes``: the ledger's ``backward_each``), its
writes then in order; with it off each is a call of its own. Buffer
operations, per parameter-sized buffer of B = ``buffer_params`` fp32 elements:

    device slots   write: an add, (4 + 2 s) B bytes of device traffic (s: slot bytes per element);
                   fold into P and pending -> slot: likewise
    host slots     write: the learner copies h into the device staging buffer (8 B bytes) after
                   waiting for the previous write to have left it; the mover then holds it for the
                   D2H (4 B bytes over PCIe) and the add (B elements at the rate of
                   ``host_threads``): their sum, or with chunks of ``host_chunk_mb`` the larger
                   plus one chunk of the smaller; ``paired_writes``: S and R share one D2H
                   fold into P: H2D of s B bytes + a device add, on the learner thread;
                   pending -> slot: host adds queued on the mover like a write (the learner
                   waits only for the mover's previous work)
    the step       ends once the mover is idle (``close_batch`` syncs it)

Rewards (``workload.solve_rate``): binary values, as the ledger writes them: a trajectory whose
reward equals its slot's shift b_g (the first reward processed there) writes S alone; at close R
folds if it was written and S if mu_g != b_g, so a group whose rewards are all equal folds
nothing. Without values every reward in a group is taken as distinct (each after a slot's first
writes S and R). ``skip_zero_advantage``: a closed group's trajectory with A_i = 0 runs nothing
(a pending h_i is dropped). ``defer_uniform_groups``: a group takes a slot only once two of its
rewards differ; its rewarded trajectories wait until then (and are handed a slot only then).

Paths are decided when the event happens. A learner that is behind its events would, with
``ledger.pack_ready_work``, find some groups closed by the time it runs their work and take the
cheaper direct path: the model does not, so it is pessimistic for a backlogged learner.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from megathunder.objectives.advantages import group_mean
from megathunder.simulate.learner_model import BACKWARD_SHARE, Burst
from megathunder.simulate.profile import Profile

CALL, DIRECT, OP = range(3)
GB = 1e9
MiB = 2**20


@dataclass(frozen=True)
class Costs:
    """Seconds of each learner-side operation on one rank (module docstring)."""

    host: bool = False
    call_s: float = 0.0  # fixed cost of a schedule call
    write_block_s: float = 0.0  # learner thread per buffer write (device: the add; host: the staging copy)
    mover_s: float = 0.0  # host: staging held per single write
    mover_pair_s: float = 0.0  # host: staging held by a paired (S and R) write
    paired: bool = True
    pack_own: bool = True  # ready slot- and pending-path calls share one call (``backward_each``)
    slot_add_s: float = 0.0  # one pending -> slot add (host: on the mover)
    fold_s: float = 0.0  # one slot or pending buffer into P, learner thread
    direct_add_s: float = 0.0  # a packed call's gradient into P

    @classmethod
    def of(cls, profile: Profile) -> Costs:
        led, buf = profile.ledger, profile.buffers
        call = profile.learner.call_overhead_s
        if not led.costs:
            return cls(call_s=call, pack_own=led.pack_own_passes)
        n = profile.buffer_params
        s = 2.0 if led.slot_dtype == "bfloat16" else 4.0
        dev = lambda nbytes: nbytes / (buf.device_gb_per_s * GB)  # noqa: E731
        direct = dev(12 * n)  # P += live: read both, write P
        if led.placement == "device":
            write = dev((4 + 2 * s) * n)
            return cls(False, call, write, slot_add_s=dev(3 * s * n), fold_s=dev((8 + s) * n), direct_add_s=direct,
                       pack_own=led.pack_own_passes)
        d2h = 4 * n / (buf.d2h_gb_per_s * GB)
        add = n / buf.host_add_rate(led.host_threads)
        return cls(True, call, write_block_s=dev(8 * n),
                   mover_s=_overlapped(d2h, add, n, led.host_chunk_mb),
                   mover_pair_s=_overlapped(d2h, 2 * add, n, led.host_chunk_mb),
                   paired=led.paired_writes, pack_own=led.pack_own_passes, slot_add_s=add,
                   fold_s=s * n / (buf.h2d_gb_per_s * GB) + dev(12 * n), direct_add_s=direct)


def _overlapped(d2h: float, add: float, n: float, chunk_mb: float) -> float:
    """One staged write's mover time: D2H then add, or chunked, each chunk added while the next is
    on the wire: the longer of the two plus one chunk of the shorter."""
    if chunk_mb <= 0:
        return d2h + add
    chunks = max(1, math.ceil(4 * n / (chunk_mb * MiB)))
    return max(d2h, add) + min(d2h, add) / chunks


@dataclass
class Job:
    ready: float
    kind: int  # CALL, DIRECT or OP
    work: float = 0.0  # CALL, DIRECT: forward + backward seconds on one replica
    writes: int = 0  # CALL: buffers written from its gradient (S; S and R; a pending buffer)
    ops: int = 0  # OP: how many of ``op`` it runs
    op: str = ""  # OP: "fold" (into P) or "slot_add" (pending -> slot)
    traj: int = -1  # the trajectory it is for (-1: a slot's fold)
    path: str = ""  # CALL: "slot", "pending" or "turn"; DIRECT: "direct"; OP: "slot_fold", "pending_fold"
    seq: int = 0


@dataclass
class _Rank:
    jobs: list[Job] = field(default_factory=list)
    slots_used: int = 0
    slot_of: dict[int, int] = field(default_factory=dict)  # group -> trajectories processed in its slot
    shift: dict[int, float] = field(default_factory=dict)  # group -> its slot's b_g (with reward values)
    wrote_r: set[int] = field(default_factory=set)  # groups whose slot's R was written
    waiting: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))  # group -> own trajs
    pending_used: int = 0
    streams_used: int = 0


@dataclass(frozen=True)
class LedgerRules:
    """The ledger settings of one rank (all ranks alike)."""

    max_slots: int | None = None
    pending: bool = False
    max_pending: int | None = None
    per_turn: str = "off"  # off, kv_adjoint, forward_early
    max_streams: int | None = None
    buffers_per_slot: int = 2
    skip_zero: bool = False  # ``skip_zero_advantage``
    defer: bool = False  # ``defer_uniform_groups``

    @classmethod
    def of(cls, profile: Profile) -> LedgerRules:
        sc = profile.schedules
        per_turn = sc.per_turn_scores
        return cls(sc.max_group_slots, sc.pending_gradients or per_turn != "off", sc.max_pending, per_turn,
                   sc.max_turn_streams, profile.ledger.buffers_per_slot, sc.skip_zero_advantage,
                   sc.defer_uniform_groups and sc.skip_zero_advantage)  # the ledger's rule


def group_means(group: np.ndarray, value: np.ndarray) -> np.ndarray:
    """[G] each group's mean reward, bitwise as the ledger computes it (``group_mean``)."""
    members: list[list[float]] = [[] for _ in range(int(group.max()) + 1)]
    for g, v in zip(group.tolist(), value.tolist(), strict=True):
        members[g].append(v)
    return np.array([group_mean(m) if m else math.nan for m in members])


def zero_advantage(group: np.ndarray, value: np.ndarray | None, means: np.ndarray | None = None) -> np.ndarray:
    """[B] trajectories whose advantage ``coef_g * (r_i - mu_g)`` is exactly 0: a reward equal to
    its group's mean (every member of an all-equal group). None (rewards distinct within every
    group): none. ``means``: ``group_means`` if already computed."""
    if value is None:
        return np.zeros(len(group), dtype=bool)
    return value == (group_means(group, value) if means is None else means)[group]


def claim_owners(claim_time: np.ndarray, tokens: np.ndarray, dp: int) -> np.ndarray:
    """Each trajectory's rank: the least loaded by tokens (lowest on ties) when it is claimed, in
    claim order (``Ownership.claim``)."""
    owner = np.zeros(len(claim_time), dtype=np.int64)
    if dp == 1:
        return owner
    heap = [(0, r) for r in range(dp)]
    for i in np.argsort(claim_time, kind="stable"):
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + int(tokens[i]), r))
    return owner


def ledger_jobs(rules: LedgerRules, group: np.ndarray, finish: np.ndarray, reward: np.ndarray, work: np.ndarray,
                owner: np.ndarray, dp: int, turns: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
                value: np.ndarray | None = None) -> list[list[Job]]:
    """Per rank, the jobs the ledger's rules give (module docstring). ``turns`` (per-turn scores):
    per turn its trajectory, end time and work share, and per trajectory the finish item's work.
    ``value``: each trajectory's reward (None: distinct within every group)."""
    ranks = [_Rank() for _ in range(dp)]
    values = value is not None
    vals = np.zeros(len(group)) if value is None else value
    mean = group_means(group, vals)
    zero = rules.skip_zero & zero_advantage(group, value, mean)
    first_value: dict[int, float] = {}  # group -> its first reward (every rank sees every reward)
    distinct: set[int] = set()  # groups with two different rewards seen
    defer = rules.defer and values
    remaining = np.bincount(group).astype(np.int64)
    pend = np.zeros(len(group), dtype=bool)
    streamed = np.zeros(len(group), dtype=bool)
    finished = np.zeros(len(group), dtype=bool)
    rewarded = np.zeros(len(group), dtype=bool)
    members: dict[int, list[int]] = defaultdict(list)  # group -> its trajectories in sample order
    for i, g in enumerate(group.tolist()):
        members[g].append(i)
    events: list[tuple[float, int, int, int]] = []  # (time, kind: 0 turn, 1 finish, 2 reward, index)
    if turns is not None:
        traj_of_turn, turn_end, _, _ = turns
        first = np.ones(len(traj_of_turn), dtype=bool)
        first[1:] = traj_of_turn[1:] != traj_of_turn[:-1]
        events += [(float(turn_end[k]), 0, int(k), 0) for k in range(len(traj_of_turn))]
    events += [(float(finish[i]), 1, int(i), 0) for i in range(len(group))]
    events += [(float(reward[i]), 2, int(i), 0) for i in range(len(group))]
    events.sort()
    seq = 0

    def add(rank: _Rank, job: Job) -> None:
        nonlocal seq
        job.seq = seq
        seq += 1
        rank.jobs.append(job)

    def slot_free(rank: _Rank) -> bool:
        return rules.max_slots is None or rank.slots_used < rules.max_slots

    def pending_free(rank: _Rank) -> bool:
        return rules.pending and (rules.max_pending is None or rank.pending_used < rules.max_pending)

    def into_slot(rank: _Rank, g: int, i: int, t: float) -> None:
        n = rank.slot_of[g]
        rank.slot_of[g] = n + 1
        if n == 0 and values:
            rank.shift[g] = float(vals[i])
        same = n == 0 or (values and float(vals[i]) == rank.shift[g])
        writes = 1 if same or rules.buffers_per_slot == 1 else 2
        if writes == 2:
            rank.wrote_r.add(g)
        if pend[i]:
            pend[i] = False
            rank.pending_used -= 1
            add(rank, Job(t, OP, ops=writes, op="slot_add", traj=i, path="pending_fold"))
        else:
            add(rank, Job(t, CALL, work=float(work[i]), writes=writes, traj=i, path="slot"))

    def close(g: int, last: int, t: float) -> None:
        for d, rank in enumerate(ranks):
            direct = list(rank.waiting.pop(g, []))
            if owner[last] == d:
                direct.append(last)
            if g in rank.slot_of:
                n = rank.slot_of.pop(g)
                if values:  # R if written, S if mu_g != b_g
                    folds = int(g in rank.wrote_r) + int(float(mean[g]) != rank.shift.pop(g))
                    rank.wrote_r.discard(g)
                else:
                    folds = 1 if n == 1 or rules.buffers_per_slot == 1 else 2
                if folds:
                    add(rank, Job(t, OP, ops=folds, op="fold", path="slot_fold"))
                rank.slots_used -= 1
                _direct(rank, direct, t)
                _hand_over(rank, t)
            else:
                _direct(rank, direct, t)

    def _direct(rank: _Rank, members: list[int], t: float) -> None:
        for i in members:
            if pend[i]:
                pend[i] = False
                rank.pending_used -= 1
                if not zero[i]:
                    add(rank, Job(t, OP, ops=1, op="fold", traj=i, path="pending_fold"))
            elif not zero[i]:
                add(rank, Job(t, DIRECT, work=float(work[i]), traj=i, path="direct"))

    def _hand_over(rank: _Rank, t: float) -> None:
        """The freed slot to the group with most own trajectories waiting (first on ties); its
        members, in sample order, go into it, and those finished but not rewarded take a free
        pending buffer (the ledger advances every member of the group)."""
        waiting = [(len(ws), -g, g) for g, ws in rank.waiting.items() if ws and (not defer or g in distinct)]
        if not waiting:
            return
        g = max(waiting)[2]
        ready = set(rank.waiting.pop(g))
        rank.slot_of[g] = 0
        rank.slots_used += 1
        for i in members[g]:
            if i in ready:
                into_slot(rank, g, i, t)
            elif ranks[owner[i]] is rank and finished[i] and not rewarded[i] and not pend[i] and pending_free(rank):
                take_pending(rank, i, t)

    def take_pending(rank: _Rank, i: int, t: float) -> None:
        pend[i] = True
        rank.pending_used += 1
        add(rank, Job(t, CALL, work=float(work[i]), writes=1, traj=i, path="pending"))

    for t, kind, idx, _ in events:
        if kind == 0:
            assert turns is not None
            i = int(traj_of_turn[idx])
            rank = ranks[owner[i]]
            if first[idx] and (rules.max_streams is None or rank.streams_used < rules.max_streams) \
                    and pending_free(rank):
                streamed[i] = pend[i] = True
                rank.streams_used += 1
                rank.pending_used += 1
            if streamed[i]:
                share = float(turns[2][idx])
                add(rank, Job(t, CALL, work=share, writes=1 if rules.per_turn == "kv_adjoint" else 0, traj=i,
                              path="turn"))
        elif kind == 1:
            rank = ranks[owner[idx]]
            if streamed[idx]:
                assert turns is not None
                rank.streams_used -= 1
                add(rank, Job(t, CALL, work=float(turns[3][idx]), writes=1, traj=idx, path="pending"))
            elif pending_free(rank):
                take_pending(rank, idx, t)
            finished[idx] = True
        else:
            g = int(group[idx])
            rewarded[idx] = True
            remaining[g] -= 1
            became_distinct = False
            if values:
                v = first_value.setdefault(g, float(vals[idx]))
                if v != float(vals[idx]) and g not in distinct:
                    distinct.add(g)
                    became_distinct = True
            if remaining[g] == 0:
                close(g, idx, t)
                continue
            rank = ranks[owner[idx]]
            if defer and g not in distinct:  # all its rewards equal so far: wait as data
                rank.waiting[g].append(idx)
                continue
            if defer and became_distinct:  # every rank advances its members of the group: the
                rank.waiting[g].append(idx)  # waiting ones first (their common reward is b_g)
                for d, r in enumerate(ranks):
                    ready = set(r.waiting.pop(g, []))
                    for i in [*(i for i in members[g] if i != idx), idx]:
                        if owner[i] != d:
                            continue
                        if i in ready:
                            if g not in r.slot_of and slot_free(r):
                                r.slot_of[g] = 0
                                r.slots_used += 1
                            if g in r.slot_of:
                                into_slot(r, g, i, t)
                            else:  # no slot free: it waits for one
                                r.waiting[g].append(i)
                        elif finished[i] and not rewarded[i] and not pend[i] and pending_free(r):
                            take_pending(r, i, t)
                continue
            if g in rank.slot_of:
                into_slot(rank, g, idx, t)
            elif slot_free(rank):
                rank.slot_of[g] = 0
                rank.slots_used += 1
                into_slot(rank, g, idx, t)
            else:
                rank.waiting[g].append(idx)
    assert not pend.any(), "internal: a pending gradient was never folded"
    return [r.jobs for r in ranks]


def run_rank(rank: int, jobs: list[Job], t0: float, p: int, costs: Costs, max_burst: int) -> list[Burst]:
    """One rank's calls and buffer operations from t0 (module docstring); the last span ends when
    the rank's part of the step is done (its mover idle)."""
    jobs = sorted(jobs, key=lambda j: (j.ready, j.seq))
    spans: list[Burst] = []
    now, mover = t0, t0
    queue: list[Job] = []
    k = 0

    def ledger_span(start: float, end: float) -> None:
        if end > start:
            spans.append(Burst(rank, start, end, 0, 0.0, "ledger"))

    while k < len(jobs) or queue:
        if not queue:
            now = max(now, jobs[k].ready)
        while k < len(jobs) and jobs[k].ready <= now:
            queue.append(jobs[k])
            k += 1
        job = queue.pop(0)
        if job.kind == DIRECT:
            batch = [job] + [j for j in queue if j.kind == DIRECT][: max_burst - 1]
            queue = [j for j in queue if not any(j is b for b in batch)]
            total = sum(j.work for j in batch)
            end = now + costs.call_s + total * (len(batch) + p - 1) / len(batch)
            spans.append(Burst(rank, now, end, len(batch), BACKWARD_SHARE * batch[-1].work))
            now = end
            ledger_span(now, now + costs.direct_add_s)
            now += costs.direct_add_s
        elif job.kind == CALL:
            batch = [job]
            if costs.pack_own and job.path != "turn":
                batch += [j for j in queue if j.kind == CALL and j.path != "turn"][: max_burst - 1]
                queue = [j for j in queue if not any(j is b for b in batch)]
            # The pipeline fills, then each trajectory's backward ends in turn and its writes go
            # at once (``backward_each`` hands it over before the next one's backward), so the
            # mover's work overlaps the next trajectories' compute; the call's compute span
            # first, what its writes blocked it after it.
            total = sum(j.work for j in batch)
            compute = costs.call_s + total * (len(batch) + p - 1) / len(batch)
            t = now + costs.call_s + total * (p - 1) / len(batch)
            for j in batch:
                t += j.work
                if costs.host:
                    units = [costs.mover_pair_s] if j.writes == 2 and costs.paired else [costs.mover_s] * j.writes
                    for held in units:
                        t = max(t, mover) + costs.write_block_s
                        mover = t + held
                else:
                    t += j.writes * costs.write_block_s
            spans.append(Burst(rank, now, now + compute, len(batch), BACKWARD_SHARE * batch[-1].work))
            ledger_span(now + compute, t)
            now = t
        else:
            start = now
            if costs.host:
                now = max(now, mover)  # a fold reads a slot the mover writes; an add queues behind it
            if costs.host and job.op == "slot_add":  # queued on the mover like a write
                mover = now + job.ops * costs.slot_add_s
            else:
                now += job.ops * (costs.fold_s if job.op == "fold" else costs.slot_add_s)
            ledger_span(start, now)
    if mover > now:  # close_batch waits for the last host add
        ledger_span(now, mover)
    return spans
