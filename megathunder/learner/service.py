"""The learner as a service: every learner call runs on one worker thread, on every rank.

The controller (global rank 0) lives on an asyncio loop with the rollout side; learner work
(backward passes, optimizer steps, weight gathers) runs on a worker thread so rollouts, tool
calls and verifiers keep going while the learner computes -- that overlap is the point of
streaming. Calls run in submission order, so events reach the ledger in the order they happened.

A call is a method of the endpoint (``LearnerEndpoint``, ``megathunder.learner.endpoint``):
``service.submit(LearnerEndpoint.finished, traj)``. Across ranks the controller channel is
torch.distributed itself: before running a call, rank 0 broadcasts the method's name and its
arguments on a gloo group of the learner's world, and every other rank runs the same method of its
own endpoint from ``serve()``. We use torch.distributed rather than mpi4py because the learner
already has the group, it works the same under torchrun and Slurm's srun, and nothing else has
to be installed on the cluster. Collectives inside the calls (DP reduce, TP/PP exchange, the
weight gather) then line up on all ranks by construction.

Each call is timed; the spans feed the run's timeline.

Ready work. Rank 0 tells every rank, with each call, whether more calls were already queued behind
it when it started (``more_queued``, set on the endpoint before the call). An endpoint with a
``ready_work`` method has it run after each call that had none queued behind it: the learner is
about to be free, so work that the queued calls held back (``LearnerEndpoint``: backward passes
of a run of events) runs then, packed. The flag travels with the call, so all ranks hold and
release at the same calls.

Failure: every rank writes a heartbeat to the job's store each second. When a collective fails on
rank 0 (gloo notices a dead peer within a second), it names the ranks whose heartbeat stopped and
raises ``LearnerRankLost``; the run ends at once, and the last checkpoint (written atomically)
resumes it. A follower that loses rank 0 exits with a message saying so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import torch.distributed as dist

from megathunder.learner import cpu_compat

E = TypeVar("E")  # the endpoint: LearnerEndpoint in training
P = ParamSpec("P")
R = TypeVar("R")
_STOP = "__stop__"
HEARTBEAT_S = 1.0


class LearnerRankLost(RuntimeError):
    """A learner rank died or became unreachable; the message names it."""


class _Heartbeat:
    """Each rank stamps ``megathunder/alive/<rank>`` in the process group's store every second."""

    def __init__(self, rank: int, world_size: int) -> None:
        # The default group's store (torchrun's / our rendezvous'): private but long-stable API.
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.world_size = rank, world_size
        self._stop = threading.Event()
        self._beat()
        threading.Thread(target=self._loop, name="heartbeat", daemon=True).start()

    def _beat(self) -> None:
        self.store.set(f"megathunder/alive/{self.rank}", repr(time.time()))

    def _loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except Exception:  # the store is gone with rank 0: the collectives report it
                return

    def silent_ranks(self) -> list[tuple[int, float]]:
        """(rank, seconds since its last heartbeat) for ranks silent for over 2.5 beats."""
        time.sleep(2.5 * HEARTBEAT_S)
        out: list[tuple[int, float]] = []
        now = time.time()
        for r in range(self.world_size):
            key = f"megathunder/alive/{r}"
            age = now - float(self.store.get(key)) if self.store.check([key]) else float("inf")
            if age > 2.5 * HEARTBEAT_S:
                out.append((r, age))
        return out

    def stop(self) -> None:
        self._stop.set()


@dataclass
class Span:
    kind: str
    start: float  # time.monotonic()
    end: float
    step: int


@dataclass
class LearnerService(Generic[E]):
    """Runs ``endpoint``'s methods on a worker thread, on every rank (module docstring)."""

    endpoint: E
    rank: int = 0
    world_size: int = 1
    spans: list[Span] = field(default_factory=list)
    step_index: int = 0  # the optimizer step the calls belong to (the timeline's spans)

    def __post_init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="learner", initializer=cpu_compat.enable_in_this_thread
        )
        self._group = dist.new_group(backend="gloo") if self.world_size > 1 else None
        self._heartbeat = _Heartbeat(self.rank, self.world_size) if self.world_size > 1 else None
        self._lock = threading.Lock()
        self._queued: set[concurrent.futures.Future] = set()
        self._num_submitted = self._num_started = 0  # calls, for ``more_queued``

    # ------------------------------------------------------------------ controller (rank 0)

    def submit(self, method: Callable[Concatenate[E, P], R], *args: P.args, **kwargs: P.kwargs) -> concurrent.futures.Future[R]:
        """Queue ``method(endpoint, *args, **kwargs)``; it runs after every call submitted before it."""
        name = method.__name__
        if getattr(type(self.endpoint), name, None) is not method:
            raise TypeError(f"{method!r} is not a method of {type(self.endpoint).__name__}")
        with self._lock:
            self._num_submitted += 1
        future = self._pool.submit(self._run, name, args, kwargs)
        with self._lock:
            self._queued.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._queued.discard(future)

    async def call(self, method: Callable[Concatenate[E, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.wrap_future(self.submit(method, *args, **kwargs))

    def stop(self, cancel_pending: bool = False) -> None:
        """Stop every rank's service after the calls submitted so far (``cancel_pending``: after
        the call running now; the rest are dropped)."""
        if cancel_pending:  # queued calls never reach any rank: the ranks stay in step
            with self._lock:
                queued = list(self._queued)
            for future in queued:
                future.cancel()
        if self.world_size > 1:
            try:
                self._pool.submit(self._run, _STOP, (), {}).result()
            except LearnerRankLost:
                pass  # already reported by the call that found it
            self._beats.stop()
        self._pool.shutdown(wait=True)

    @property
    def _beats(self) -> _Heartbeat:
        """The heartbeat, which every rank of a world of more than one process runs."""
        assert self._heartbeat is not None, "no heartbeat in a single-process world"
        return self._heartbeat

    def _broadcast(self, msg: Any) -> Any:
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _run(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        with self._lock:
            self._num_started += 1
            more = self._num_submitted > self._num_started  # calls queued behind this one
        if self.world_size == 1:
            return self._execute(method, args, kwargs, more)
        try:
            self._broadcast((method, args, kwargs, more))
            return None if method == _STOP else self._execute(method, args, kwargs, more)
        except RuntimeError as err:  # gloo: a peer closed its connection or timed out
            silent = self._beats.silent_ranks()
            if not silent:
                raise  # every rank is alive: a real error of the call itself
            who = ", ".join(f"rank {r} (silent {age:.0f} s)" for r, age in silent)
            raise LearnerRankLost(
                f"learner call '{method}' failed: {who} stopped responding; the run stops now and "
                f"resumes from its last checkpoint when restarted ({str(err).splitlines()[0][:200]})"
            ) from err

    def _execute(self, method: str, args: tuple, kwargs: dict[str, Any], more_queued: bool = False) -> Any:
        start = time.monotonic()
        ready_work = getattr(self.endpoint, "ready_work", None)
        try:
            if ready_work is not None:
                self.endpoint.more_queued = more_queued  # type: ignore[attr-defined]
            result = getattr(self.endpoint, method)(*args, **kwargs)
            if ready_work is not None and not more_queued:
                ready_work()
            return result
        finally:
            with self._lock:
                self.spans.append(Span(method, start, time.monotonic(), self.step_index))

    # ------------------------------------------------------------------ followers (rank > 0)

    def serve(self) -> None:
        """Run rank 0's calls until it stops the service."""
        while True:
            try:
                method, args, kwargs, more = self._broadcast(None)
            except RuntimeError as err:
                raise LearnerRankLost(
                    f"learner rank {self.rank}: lost the controller (rank 0): {str(err).splitlines()[0][:200]}"
                ) from err
            if method == _STOP:
                self._beats.stop()
                return
            self._execute(method, args, kwargs, more)

    def forget_spans_before(self, step: int) -> None:
        """Drop the spans of optimizer steps before ``step`` (the timeline keeps a window)."""
        with self._lock:
            self.spans = [s for s in self.spans if s.step >= step]

    def busy_seconds(self, since: float, until: float, kinds: set[str] | None = None) -> float:
        with self._lock:
            return sum(
                max(0.0, min(s.end, until) - max(s.start, since))
                for s in self.spans if kinds is None or s.kind in kinds
            )
