"""The four schedules, each a short loop over steps on the same sampled batches.

Weight versions: the learner's step j trains at version j and publishes j + 1. A batch's
staleness is (learner version at its step) - (version its trajectories started with).

- sync: rollout of batch j starts once version j is live; the learner waits for the last reward,
  trains the batch, steps, pushes the weights.                                   (staleness 0)
- async (one-step-off): rollout of batch j + 1 runs with version j while the learner trains on
  batch j; the push happens between two rollout batches.                         (staleness 1)
- fully_async: groups launch continuously (at most max_in_flight_prompts at once, and at most
  max_staleness versions ahead); the learner takes the first num_prompts_per_batch closed groups;
  each push pauses the engines, in-flight trajectories continue on the new weights.
- thunder: as sync, but each trajectory's forward+backward runs when the ledger can take it
  (its own reward with a group slot, its group's close without one), so after the last reward
  only the last trajectory's backward, the optimizer step and the push remain.   (staleness 0)
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from megathunder.config import SCHEDULE_MODES
from megathunder.simulate.learner_model import (
    BACKWARD_SHARE,
    Burst,
    burst_s,
    train_batch,
    trajectory_work_s,
    turn_items,
    update_tail_s,
)
from megathunder.simulate import ledger_model
from megathunder.simulate.ledger_model import Costs, LedgerRules, claim_owners, ledger_jobs, run_rank
from megathunder.simulate.profile import Profile
from megathunder.simulate.rollout_model import Interval, RolloutCluster
from megathunder.simulate.workload import Batch, sample_batch

SCHEDULES = SCHEDULE_MODES


@dataclass
class Step:
    step: int
    end: float  # the step's weights are live in the engines (async: the optimizer step is done)
    rollout_wait_s: float  # from its rollout's start to its last reward
    learner_tail_s: float  # from its last reward to `end` (learner work left)
    staleness: np.ndarray  # per trajectory
    arrival_bound_s: float = np.nan  # zero-staleness lower bound on this step (sync, thunder)
    first_reward_s: float = np.nan  # from its rollout's start to its first reward (sync, thunder)


@dataclass
class Trace:
    schedule: str
    profile: Profile
    steps: list[Step] = field(default_factory=list)
    intervals: list[Interval] = field(default_factory=list)
    decoded_tokens: float = 0.0


def sample_batches(profile: Profile, n: int) -> list[Batch]:
    """Common random numbers: batch k is the same for every schedule."""
    return [sample_batch(profile.workload, np.random.default_rng([profile.run.seed, k]))
            for k in range(n)]


@dataclass
class Rolled:
    """One batch's rollout: per trajectory its reward and finish times, per turn (flat, the
    batch's CSR order) when it ended."""

    reward: np.ndarray
    finish: np.ndarray
    turn_end: np.ndarray
    decoding: list[tuple[float, float]] = field(default_factory=list)  # when any engine decoded, merged


def _rollout(profile: Profile, batch: Batch, t0: float, trace: Trace, step: int) -> Rolled:
    """Runs one batch from idle engines at t0."""
    cluster = RolloutCluster(profile)
    cluster.add_batch(batch, t0)
    cluster.run()
    cluster.close(cluster.now)
    for iv in cluster.intervals:
        iv.step = step
    trace.intervals += cluster.intervals
    trace.decoded_tokens += cluster.decoded_tokens
    turn_end = np.asarray([t for ends in cluster.turn_end_time for t in ends])
    decoding: list[tuple[float, float]] = []
    for iv in sorted((iv for iv in cluster.intervals if iv.kind == "decode"), key=lambda iv: iv.start):
        if decoding and iv.start <= decoding[-1][1]:
            decoding[-1] = (decoding[-1][0], max(decoding[-1][1], iv.end))
        else:
            decoding.append((iv.start, iv.end))
    return Rolled(np.asarray(cluster.reward_time), np.asarray(cluster.finish_time), turn_end, decoding)


def held_until_idle(ready: float, decoding: list[tuple[float, float]]) -> float:
    """``ready``, or the end of the decoding span it falls in (``schedules.hold_while_generating``)."""
    k = bisect.bisect_right(decoding, (ready, math.inf)) - 1
    return max(ready, decoding[k][1]) if k >= 0 and decoding[k][0] <= ready < decoding[k][1] else ready


def _learner(profile: Profile, bursts: list[Burst], trace: Trace, step: int, not_before: float = -math.inf) -> float:
    """Records bursts and the update tail on every rank; returns the time the weights are live.
    The update starts at ``not_before`` at the earliest (the last reward: with every advantage of
    the last groups 0 nothing may be left to run after it)."""
    last = max(bursts, key=lambda b: b.end, default=None)
    if last is None or last.end < not_before:
        last = Burst(0, not_before, not_before, 0, 0.0)
    end = last.end + update_tail_s(profile, last.last_backward_s)
    for b in bursts:
        trace.intervals.append(Interval(f"learner{b.rank}", b.start, b.end, b.kind, step))
    busy_end = max(last.end, end - (profile.learner.weight_sync_s - profile.learner.push_busy_s))
    for r in range(profile.num_dp):
        trace.intervals.append(Interval(f"learner{r}", last.end, busy_end, "update", step))
    return end


def _push(profile: Profile, end: float, trace: Trace, step: int) -> None:
    s = min(profile.learner.weight_sync_s, end)
    for k in range(profile.num_engines):
        trace.intervals.append(Interval(f"rollout{k}", end - s, end, "weight_sync", step))


def zero_advantage(profile: Profile, batch: Batch) -> np.ndarray:
    """[B] trajectories whose gradient is exactly 0 and is skipped (``skip_zero_advantage``)."""
    if not profile.schedules.skip_zero_advantage:
        return np.zeros(batch.size, dtype=bool)
    return ledger_model.zero_advantage(batch.group, batch.reward_value)


def arrival_bound_s(profile: Profile, reward: np.ndarray, work: np.ndarray) -> float:
    """Earliest end of a zero-staleness step with these reward times: no trajectory's backward
    before its reward, learner work shared perfectly by the data-parallel ranks, no bubble:

        max_i ( r_i + sum_{j: r_j >= r_i} work_j / dp ) + update tail after the last backward

    With one rank and no pipeline, per-trajectory streaming (K = inf) attains it exactly.
    """
    order = np.argsort(reward, kind="stable")
    r, w = reward[order], work[order] / profile.num_dp
    after = np.cumsum(w[::-1])[::-1]  # work ready at or after r_i (ties: counted from the first)
    return float((r + after).max()) + update_tail_s(profile, BACKWARD_SHARE * float(work[order[-1]]))


def _zero_staleness(profile: Profile, batches: list[Batch], thunder: bool) -> Trace:
    """sync and thunder: rollout j starts when version j is live; they differ in when the
    learner may take each trajectory."""
    trace = Trace("thunder" if thunder else "sync", profile)
    p, dp = profile.learner.pipeline_parallel, profile.num_dp
    t = 0.0
    for k, batch in enumerate(batches):
        rolled = _rollout(profile, batch, t, trace, k)
        reward = rolled.reward
        work = trajectory_work_s(profile, batch)
        needed = np.where(zero_advantage(profile, batch), 0.0, work)  # after the rewards
        if thunder:
            bursts = thunder_bursts(profile, batch, rolled, work, t)
        else:
            bursts = sync_bursts(profile, batch, rolled, needed)
        last_reward = float(reward.max())
        end = _learner(profile, bursts, trace, k, not_before=last_reward)
        _push(profile, end, trace, k)
        trace.steps.append(Step(k, end, last_reward - t, end - last_reward, np.zeros(batch.size),
                                arrival_bound_s(profile, reward, needed) - t, float(reward.min()) - t))
        t = end
    return trace


def owners(profile: Profile, batch: Batch, rolled: Rolled) -> np.ndarray:
    """Each trajectory's data-parallel rank (``ledger_model.claim_owners``): claimed at its first
    turn's end with per-turn scores on, else at its finish."""
    claim = rolled.finish
    if profile.schedules.per_turn_scores != "off":
        claim = rolled.turn_end[batch.turn_start[:-1]]
    return claim_owners(claim, batch.total_tokens, profile.num_dp)


def sync_bursts(profile: Profile, batch: Batch, rolled: Rolled, work: np.ndarray) -> list[Burst]:
    """The batch-synchronous learner: after the last reward each rank runs its own trajectories
    (``owners``) in one schedule call."""
    owner, p = owners(profile, batch, rolled), profile.learner.pipeline_parallel
    t = float(rolled.reward.max())
    bursts = []
    for r in range(profile.num_dp):
        ws = work[(owner == r) & (work > 0)]
        if len(ws):
            end = t + profile.learner.call_overhead_s + burst_s(float(ws.sum()), len(ws), p)
            bursts.append(Burst(r, t, end, len(ws), BACKWARD_SHARE * float(ws[-1])))
    return bursts


def thunder_bursts(profile: Profile, batch: Batch, rolled: Rolled, work: np.ndarray, t0: float) -> list[Burst]:
    """Thunder's learner: each rank's ledger decides the path and time of each of its trajectories'
    gradients and the buffer operations they need; each rank runs them with their costs
    (``ledger_model``). With ``per_turn_scores`` each turn's share is its own item (``turn_items``)."""
    sched, dp = profile.schedules, profile.num_dp
    turns = None
    if sched.per_turn_scores != "off":
        _, items = turn_items(batch, work, rolled.turn_end, rolled.finish, sched.per_turn_scores)
        n = len(rolled.turn_end)
        turns = (np.repeat(np.arange(batch.size), batch.num_turns), rolled.turn_end, items[:n], items[n:])
    jobs = ledger_jobs(LedgerRules.of(profile), batch.group, rolled.finish, rolled.reward, work,
                       owners(profile, batch, rolled), dp, turns, batch.reward_value)
    if sched.hold_while_generating:
        for job in (j for rank in jobs for j in rank):
            job.ready = held_until_idle(job.ready, rolled.decoding)
    costs, p = Costs.of(profile), profile.learner.pipeline_parallel
    return [b for r in range(dp) for b in run_rank(r, jobs[r], t0, p, costs, profile.learner.max_microbatches_per_burst)]


def run_sync(profile: Profile, batches: list[Batch]) -> Trace:
    return _zero_staleness(profile, batches, thunder=False)


def run_thunder(profile: Profile, batches: list[Batch]) -> Trace:
    return _zero_staleness(profile, batches, thunder=True)


def run_async(profile: Profile, batches: list[Batch]) -> Trace:
    """One-step-off: rollout j starts at max(rollout j-1 done, learner step j-2 done) + push; the
    learner trains batch j - 1 from then on, or once the push is done (``schedules.
    async_push_overlaps_training`` false)."""
    trace = Trace("async", profile)
    p, dp, s = profile.learner.pipeline_parallel, profile.num_dp, profile.learner.weight_sync_s
    overlap = profile.schedules.async_push_overlaps_training
    rollout_end: list[float] = []
    learner_end: list[float] = []
    for k, batch in enumerate(batches):
        if k == 0:
            start, version = 0.0, 0
        elif k == 1:
            start, version = rollout_end[0], 0
        else:
            push = max(rollout_end[k - 1], learner_end[k - 2])
            start, version = push + s, k - 1
            _push(profile, start, trace, k)
            for r in range(dp if overlap else 0):  # the learner sends a copy of version k-1 while it trains
                trace.intervals.append(Interval(f"learner{r}", push, push + profile.learner.push_busy_s,
                                                "weight_sync", k))
        reward = _rollout(profile, batch, start, trace, k).reward
        rollout_end.append(float(reward.max()))
        t_learn = max(rollout_end[k], learner_end[k - 1] if k else 0.0)
        if k and not overlap:  # the push of version k (before rollout k + 1) completes first
            for r in range(dp):
                trace.intervals.append(Interval(f"learner{r}", t_learn, t_learn + profile.learner.push_busy_s,
                                                "weight_sync", k))
            t_learn += s
        work = trajectory_work_s(profile, batch)
        bursts = train_batch(work[~zero_advantage(profile, batch)], dp, p, t_learn)
        last = max(bursts, key=lambda b: b.end, default=Burst(0, t_learn, t_learn, 0, 0.0))
        end = last.end + profile.learner.optimizer_step_s
        for b in bursts:
            trace.intervals.append(Interval(f"learner{b.rank}", b.start, b.end, "train", k))
        for r in range(dp):
            trace.intervals.append(Interval(f"learner{r}", last.end, end, "update", k))
        learner_end.append(end)
        trace.steps.append(Step(k, end, rollout_end[k] - start, end - rollout_end[k],
                                np.full(batch.size, float(k - version))))
    return trace


class _FullyAsync:
    """Continuous generation with bounded staleness; the learner takes closed groups FIFO.

    Group n (of the whole run) is prompt n % P of batch n // P. It may launch while fewer than
    ``max_in_flight_prompts`` groups are in flight and n // P <= version + max_staleness (AReaL's
    rule, checked at launch: a group that closes late can still be consumed staler than that).
    """

    def __init__(self, profile: Profile, batches: list[Batch]):
        self.profile, self.batches = profile, batches
        self.P, self.S = profile.workload.num_prompts_per_batch, profile.workload.samples_per_prompt
        self.cap = profile.schedules.max_in_flight_prompts or self.P
        self.work = [np.where(zero_advantage(profile, b), 0.0, trajectory_work_s(profile, b)) for b in batches]
        self.trace = Trace("fully_async", profile)
        self.cluster = RolloutCluster(profile, on_reward=self.on_reward)
        self.version = self.launched = self.in_flight = 0
        self.busy = False
        self.group_of: list[int] = []  # trajectory id -> group number
        self.remaining: dict[int, int] = {}
        self.launch_version: dict[int, int] = {}
        self.closed_at: dict[int, float] = {}
        self.closed: deque[int] = deque()

    def run(self) -> Trace:
        self.launch(0.0)
        self.cluster.run()
        self.cluster.close(self.cluster.now)
        if len(self.trace.steps) < self.profile.run.num_steps:
            raise RuntimeError(f"fully_async: only {len(self.trace.steps)} steps completed; "
                               "sample more batches")
        self.trace.intervals += self.cluster.intervals
        self.trace.decoded_tokens = self.cluster.decoded_tokens
        return self.trace

    def launch(self, t: float) -> None:
        eta = self.profile.schedules.max_staleness
        while (self.in_flight < self.cap and self.launched < len(self.batches) * self.P
               and self.launched // self.P <= self.version + eta):
            n = self.launched
            local = np.arange((n % self.P) * self.S, (n % self.P + 1) * self.S)
            ids = self.cluster.add_batch(self.batches[n // self.P], t, local)
            self.group_of.extend([n] * len(ids))
            self.remaining[n], self.launch_version[n] = len(ids), self.version
            self.launched += 1
            self.in_flight += 1

    def on_reward(self, traj: int, t: float) -> None:
        n = self.group_of[traj]
        self.remaining[n] -= 1
        if self.remaining[n] == 0:
            self.closed_at[n] = t
            self.closed.append(n)
            self.in_flight -= 1
            self.launch(t)
            self.try_step(t)

    def try_step(self, t: float) -> None:
        steps, P, S = self.trace.steps, self.P, self.S
        if self.busy or len(self.closed) < P or len(steps) >= self.profile.run.num_steps:
            return
        k = len(steps)
        groups = [self.closed.popleft() for _ in range(P)]
        work = np.concatenate([self.work[n // P][(n % P) * S:(n % P + 1) * S] for n in groups])
        work = work[work > 0]  # skipped: advantage 0
        bursts = train_batch(work, self.profile.num_dp, self.profile.learner.pipeline_parallel, t)
        end = _learner(self.profile, bursts, self.trace, k, not_before=t)
        pause = min(self.profile.learner.weight_sync_s, end - t)
        if pause > 0:
            self.cluster.pause(end - pause, pause, k)
        prev_end = steps[-1].end if steps else 0.0
        staleness = np.repeat([k - self.launch_version[n] for n in groups], S).astype(float)
        steps.append(Step(k, end, t - prev_end, end - t, staleness))
        self.busy = True
        self.cluster.call_at(end, self.finish)

    def finish(self, t: float) -> None:
        self.busy = False
        self.version += 1
        self.launch(t)
        self.try_step(t)


def run_fully_async(profile: Profile, batches: list[Batch]) -> Trace:
    return _FullyAsync(profile, batches).run()


RUNNERS = {"sync": run_sync, "async": run_async, "fully_async": run_fully_async,
           "thunder": run_thunder}


def simulate(profile: Profile, schedules: tuple[str, ...] = SCHEDULES) -> dict[str, Trace]:
    """Every schedule on the same batches."""
    extra = profile.schedules.max_staleness + 2  # groups fully_async has in flight at the end
    batches = sample_batches(profile, profile.run.num_steps + extra)
    out = {}
    for name in schedules:
        own = batches if name == "fully_async" else batches[: profile.run.num_steps]
        out[name] = RUNNERS[name](profile, own)
    return out
