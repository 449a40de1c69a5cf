"""Discrete-event model of the rollout side: vLLM engines with continuous batching, sandboxes,
verifiers.

Each engine decodes up to ``max_num_seqs`` sequences at once; all of them advance at the same
rate ``rates[c]`` tokens/s (c = sequences decoding now), so an engine is a processor-sharing
server. Its *virtual clock* V (tokens decoded by every resident sequence so far) makes each event
O(log n): a turn of d tokens that joins at V0 ends when V reaches V0 + d, whatever happens to c
in between. Trajectories are pinned to one engine (prefix-cache affinity). A tool call releases
the engine; its output is then prefilled (a delay at ``prefill_tokens_per_s``; prefix caching
assumed, so only the new tokens) before the next turn queues for a decoding slot. The queue is
FIFO over turns (vLLM's default: every turn is a new request), which shares the engines evenly
and makes most trajectories finish late; ``oldest_first`` (vLLM's priority scheduling with the
trajectory's start order as priority: ``rollout.engine.scheduling=trajectory_start``) lets early
trajectories finish early; ``group_aware`` (the same name in the trainer) serves the group with the
fewest members still generating first, so groups close early.

Weight syncs pause an engine (rate 0) without dropping its sequences: in-flight trajectories
continue with the new weights afterwards (the fully-async schedules' partial rollouts). No turn
starts decoding while its engine is paused.

Replay (calibration): a batch with ``decode_s`` (measured seconds per turn) has each turn
generate for exactly that long, whatever else runs; it still holds a decoding slot. While a weight
sync pauses the engine, a replayed turn already running finishes (vLLM's pause drains running
requests) and new ones wait.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from megathunder.simulate.profile import Profile
from megathunder.simulate.workload import Batch

_READY, _DONE, _REWARD, _CALL, _REPLAYED = range(5)

_BatchLists = tuple[list[float], list[float], list[float], list[float], list[float] | None]
"""A batch's per-turn decode tokens, tool latency, observation prefill seconds, per-trajectory
verifier latency and (replay) measured decode seconds per turn, as Python lists."""


@dataclass
class Interval:
    lane: str
    start: float
    end: float
    kind: str
    step: int = -1


@dataclass(slots=True)
class _Engine:
    V: float = 0.0
    t: float = 0.0
    c: int = 0  # sequences decoding at the engine's rate
    replaying: int = 0  # replayed turns running (fixed durations)
    version: int = 0
    paused: bool = False
    resident: list = field(default_factory=list)  # heap of (finish V, traj)
    waiting: list = field(default_factory=list)  # heap of (priority, tick, traj)
    busy_since: float | None = None


class RolloutCluster:
    """Runs trajectories on the engines; ``on_reward(traj, t)`` fires when a reward arrives."""

    def __init__(self, profile: Profile, on_reward: Callable[[int, float], None] | None = None):
        spec = profile.rollout
        self.rates = spec.per_seq_rates().tolist()
        self.cap = spec.max_num_seqs
        self.prefill = spec.prefill_tokens_per_s
        self.policy = spec.queue_policy
        self.engines = [_Engine() for _ in range(profile.num_engines)]
        self.on_reward = on_reward
        self.now = 0.0
        self._heap: list = []
        self._tick = itertools.count()
        self.intervals: list[Interval] = []
        self.decoded_tokens = 0.0
        self._turn: list[int] = []  # per traj: global index of its current turn
        self._end: list[int] = []  # per traj: one past its last turn
        self._engine: list[int] = []
        self._lists: dict[int, _BatchLists] = {}  # per batch, as Python lists
        self._data: list[_BatchLists] = []  # per traj: its batch's lists
        self._first: list[int] = []  # per traj: global index of its first turn
        self._local_idx: list[int] = []  # per traj: its index in its batch
        self._group_key: list[tuple[int, int]] = []  # per traj: (its batch's number, its group)
        self._running: dict[tuple[int, int], int] = {}  # per group: members still generating
        self._num_batches = 0
        self.finish_time: list[float] = []
        self.reward_time: list[float] = []
        self.turn_end_time: list[list[float]] = []  # per traj: when each of its turns ended
        self._rr = 0

    # -- public -------------------------------------------------------------------------------
    def add_batch(self, batch: Batch, t: float, trajs: np.ndarray | None = None) -> np.ndarray:
        """Start trajectories of ``batch`` (all, or the indices ``trajs``) at time t; returns their
        global ids."""
        idx = np.arange(batch.size) if trajs is None else np.asarray(trajs)
        ids = np.arange(len(self._turn), len(self._turn) + len(idx))
        data = self._lists.get(id(batch))
        if data is None:  # numpy scalar indexing is slow on the per-event path
            data = (batch.decode_tokens.astype(float).tolist(), batch.tool_latency_s.tolist(),
                    (batch.observation_tokens / self.prefill).tolist(),
                    batch.verifier_latency_s.tolist(),
                    None if batch.decode_s is None else batch.decode_s.tolist())
            self._lists[id(batch)] = data
        batch_no = self._num_batches
        self._num_batches += 1
        for i in idx:
            gid = len(self._turn)
            key = (batch_no, int(batch.group[i]))
            self._group_key.append(key)
            self._running[key] = self._running.get(key, 0) + 1
            self._turn.append(int(batch.turn_start[i]))
            self._first.append(int(batch.turn_start[i]))
            self._end.append(int(batch.turn_start[i + 1]))
            self._engine.append(self._rr)
            self._rr = (self._rr + 1) % len(self.engines)
            self._data.append(data)
            self._local_idx.append(int(i))
            self.finish_time.append(np.nan)
            self.reward_time.append(np.nan)
            self.turn_end_time.append([])
            setup = 0.0 if batch.setup_s is None else float(batch.setup_s[i])
            self._push(t + setup + batch.prompt_tokens[i] / self.prefill, _READY, gid, None)
        return ids

    def call_at(self, t: float, fn: Callable[[float], None]) -> None:
        self._push(t, _CALL, fn, None)

    def pause(self, t: float, duration: float, step: int = -1) -> None:
        """Stop every engine's decoding over [t, t + duration] (a weight sync)."""
        def begin(now: float) -> None:
            for k, e in enumerate(self.engines):
                self._advance(e, now)
                e.paused = True
                self._busy_edge(k, e, now)
                self._predict(k, e, now)
            self.call_at(now + duration, end)

        def end(now: float) -> None:
            for k, e in enumerate(self.engines):
                self._advance(e, now)
                e.paused = False
                self._admit(k, e, now)
                self.intervals.append(Interval(f"rollout{k}", now - duration, now, "weight_sync", step))
        self.call_at(t, begin)

    def run(self, until: float = np.inf) -> None:
        """Process events up to time ``until`` (all of them by default)."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            t, _, kind, a, b = heapq.heappop(heap)
            self.now = t
            if kind == _READY:
                self._ready(a, t)
            elif kind == _DONE:
                e = self.engines[a]
                if b == e.version:
                    self._done(a, e, t)
            elif kind == _REPLAYED:
                self._replayed(a, b, t)
            elif kind == _REWARD:
                self.reward_time[a] = t
                if self.on_reward is not None:
                    self.on_reward(a, t)
            else:
                a(t)
        if until != np.inf:
            self.now = max(self.now, until)

    def close(self, t: float) -> None:
        """End open busy intervals at t (for the timeline)."""
        for k, e in enumerate(self.engines):
            if e.busy_since is not None:
                self.intervals.append(Interval(f"rollout{k}", e.busy_since, t, "decode"))
                e.busy_since = t

    # -- internals ----------------------------------------------------------------------------
    def _push(self, t: float, kind: int, a, b) -> None:
        heapq.heappush(self._heap, (t, next(self._tick), kind, a, b))

    def _rate(self, e: _Engine) -> float:
        return 0.0 if e.paused else self.rates[e.c]


    def _advance(self, e: _Engine, t: float) -> None:
        if t > e.t:
            r = self._rate(e)
            e.V += (t - e.t) * r
            self.decoded_tokens += (t - e.t) * r * e.c
            e.t = t

    def _predict(self, k: int, e: _Engine, t: float) -> None:
        e.version += 1
        r = self._rate(e)
        if e.resident and r > 0:
            self._push(t + max(0.0, e.resident[0][0] - e.V) / r, _DONE, k, e.version)

    def _busy_edge(self, k: int, e: _Engine, t: float) -> None:
        decoding = e.c + e.replaying > 0 and not e.paused
        if decoding and e.busy_since is None:
            e.busy_since = t
        elif not decoding and e.busy_since is not None:
            if t > e.busy_since:
                self.intervals.append(Interval(f"rollout{k}", e.busy_since, t, "decode"))
            e.busy_since = None

    def _join(self, k: int, e: _Engine, gid: int, t: float) -> None:
        tokens, _, _, _, replay = self._data[gid]
        turn = self._turn[gid]
        if replay is None:
            heapq.heappush(e.resident, (e.V + tokens[turn], gid))
            e.c += 1
        else:
            self._push(t + replay[turn], _REPLAYED, k, gid)
            e.replaying += 1

    def _ready(self, gid: int, t: float) -> None:
        k = self._engine[gid]
        e = self.engines[k]
        self._advance(e, t)
        tick = next(self._tick)
        heapq.heappush(e.waiting, (self._priority(gid, tick), tick, gid))
        self._admit(k, e, t)

    def _done(self, k: int, e: _Engine, t: float) -> None:
        self._advance(e, t)
        eps = 1e-9 * max(1.0, e.V)
        while e.resident and e.resident[0][0] <= e.V + eps:
            _, gid = heapq.heappop(e.resident)
            e.c -= 1
            self._turn_done(gid, t)
        self._admit(k, e, t)

    def _replayed(self, k: int, gid: int, t: float) -> None:
        e = self.engines[k]
        self._advance(e, t)
        e.replaying -= 1
        self.decoded_tokens += self._data[gid][0][self._turn[gid]]
        self._turn_done(gid, t)
        self._admit(k, e, t)

    def _turn_done(self, gid: int, t: float) -> None:
        _, tool, prefill, verifier, _ = self._data[gid]
        turn = self._turn[gid]
        self.turn_end_time[gid].append(t)
        if turn + 1 == self._end[gid]:
            self.finish_time[gid] = t
            self._running[self._group_key[gid]] -= 1
            self._push(t + verifier[self._local_idx[gid]], _REWARD, gid, None)
        else:
            self._turn[gid] = turn + 1
            self._push(t + tool[turn] + prefill[turn], _READY, gid, None)

    def _admit(self, k: int, e: _Engine, t: float) -> None:
        """Waiting turns take free decoding slots (none while paused); then the next finish."""
        while e.waiting and e.c + e.replaying < self.cap and not e.paused:
            self._join(k, e, heapq.heappop(e.waiting)[2], t)
        self._busy_edge(k, e, t)
        self._predict(k, e, t)

    def _priority(self, gid: int, tick: int) -> float:
        if self.policy == "fifo":
            return tick
        if self.policy == "oldest_first":
            return gid
        if self.policy == "group_aware":  # megathunder.rollout.priority: fewest members running, then start
            return self._running[self._group_key[gid]] * 1e12 + gid
        return gid - 1e9 * (self._turn[gid] - self._first[gid])
