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

Events in bursts. The rollout's events (a trajectory finished, its reward, a turn) come in bursts:
the sequences of one engine step finish together. ``submit_event`` queues an event call without
sending it; ``flush_events`` sends every event queued since the last flush as one message (the
trainer flushes once per turn of its event loop, and any other call or message flushes first, so
calls keep their submission order). The learner thread wakes once and, across ranks, rank 0
broadcasts once per burst instead of once per event; each event in it still runs as its own call
(its own span, and more calls queued behind it but the last), so what the learner computes and
holds is what the same events sent one by one, all queued at once, would give.

Ready work. Rank 0 tells every rank, with each call, whether more calls were already queued behind
it when it started (``more_queued``, set on the endpoint before the call). An endpoint with a
``ready_work`` method has it run after each call that had none queued behind it: the learner is
about to be free, so work that the queued calls held back (``LearnerEndpoint``: backward passes
of a run of events) runs then, packed. The flag travels with the call, so all ranks hold and
release at the same calls. An event call that finds nothing queued may wait a little for the next
one before it decides (``window``: ``megathunder.learner.pack_window.PackWindow``).

Failure (``megathunder.learner.liveness``): every rank writes a heartbeat to the job's store each
second, and the index of the learner call it started and finished as it runs each call. When a
collective fails on rank 0 (gloo notices a dead peer within a second), it names the ranks whose
heartbeat stopped and raises ``LearnerRankLost``; the run ends at once, and the last checkpoint
(written atomically) resumes it. A follower that loses rank 0 exits with a message saying so. A
rank that hangs fails no collective; rank 0's watchdog thread names it (heartbeat silent for
``heartbeat_timeout_s``, or a call in flight for over ``call_timeout_s`` that it has not finished)
and ends the process (``LEARNER_HUNG``).

Controls. ``control(name, *args)`` sends a message that is not a learner call between two calls:
every rank runs its ``controls[name](*args)`` as it receives it (installed at construction on every
rank; ``chaos.faults``' learner faults are one: the rank they name signals itself).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import torch.distributed as dist

from megathunder.cpu_cores import pin_this_thread
from megathunder.learner import cpu_compat
from megathunder.learner.liveness import CLEANUP_S, LEARNER_HUNG, Heartbeat, InFlight, Watchdog
from megathunder.learner.pack_window import PackWindow

E = TypeVar("E")  # the endpoint: LearnerEndpoint in training
P = ParamSpec("P")
R = TypeVar("R")
_STOP = "__stop__"
_EVENTS = "__events__"  # event calls sent together (``flush_events``): [(method, args), ...]
_CONTROL = "__control__"


class LearnerRankLost(RuntimeError):
    """A learner rank died or became unreachable; the message names it."""


@dataclass
class Span:
    kind: str
    start: float  # time.monotonic()
    end: float
    step: int


def drop_front(items: list, old: Callable[[Any], bool]) -> None:
    """Remove the leading ``items`` that are ``old``, in place: for windows kept in step order (the
    service's spans, the timeline's episodes and syncs), where older entries are all at the front."""
    first = 0
    while first < len(items) and old(items[first]):
        first += 1
    del items[:first]


@dataclass
class LearnerService(Generic[E]):
    """Runs ``endpoint``'s methods on a worker thread, on every rank (module docstring)."""

    endpoint: E
    rank: int = 0
    world_size: int = 1
    spans: list[Span] = field(default_factory=list)
    step_index: int = 0  # the optimizer step the calls belong to (the timeline's spans)
    heartbeat_timeout_s: float = 30.0
    """Rank 0's watchdog: a rank whose heartbeat is silent this long while a call is in flight hung."""
    call_timeout_s: float = 0.0
    """Rank 0's watchdog: a call in flight this long names the ranks that have not finished it (0: never)."""
    window: PackWindow = field(default_factory=PackWindow)
    controls: dict[str, Callable[..., None]] = field(default_factory=dict)
    """Messages that are not learner calls (``control``), by name: what every rank runs on receiving one."""
    """Rank 0: how long an event call that finds no call queued behind it waits for one."""
    cpu_cores: list[int] | None = None
    """Rank 0: the cores its learner thread computes on (``megathunder.cpu_cores``; None: unpinned,
    wherever the thread that starts it runs)."""
    on_hang: Callable[[], None] | None = None
    """Rank 0: what the watchdog runs (for at most CLEANUP_S) before it ends the process: the
    trainer closes its rollout engine. Set it before a call can hang."""

    def __post_init__(self) -> None:
        self._unpinned = sorted(os.sched_getaffinity(0))
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="learner",
                                                           initializer=self._start_learner_thread)
        self._group = dist.new_group(backend="gloo") if self.world_size > 1 else None
        self._heartbeat = Heartbeat(self.rank, self.world_size) if self.world_size > 1 else None
        self._lock = threading.Lock()
        self._submitted = threading.Condition(self._lock)  # notified on each submit (the pack window)
        self._window_calls: frozenset[str] = frozenset(getattr(self.endpoint, "WINDOW_CALLS", ()))
        self._event_calls: frozenset[str] = frozenset(getattr(self.endpoint, "EVENT_CALLS", ()))
        self._queued: set[concurrent.futures.Future] = set()
        self._num_submitted = self._num_started = 0  # calls, for ``more_queued``
        self._events: list[tuple[str, tuple]] = []  # event calls not sent yet (``submit_event``)
        self._num_wakes = 0  # messages that are not calls (a fault, stop): they end a pack window too
        self._num_calls = 0  # calls executed on this rank: the same index on every rank
        self._in_flight: InFlight | None = None  # rank 0's, read by the watchdog
        self._watchdog: Watchdog | None = None
        if self.rank == 0 and self._heartbeat is not None:
            self._watchdog = Watchdog(self._heartbeat, lambda: self._in_flight, self.heartbeat_timeout_s,
                                      self.call_timeout_s, self._on_hang)

    def _start_learner_thread(self) -> None:
        # started by the first call, from the controller's thread, which may be pinned to the rollout's
        # cores by then: unpinned, the learner keeps the cores the service was created on
        pin_this_thread(self.cpu_cores or self._unpinned, threads=self.cpu_cores is not None)
        cpu_compat.enable_in_this_thread()

    # ------------------------------------------------------------------ controller (rank 0)

    def submit(self, method: Callable[Concatenate[E, P], R], *args: P.args, **kwargs: P.kwargs) -> concurrent.futures.Future[R]:
        """Queue ``method(endpoint, *args, **kwargs)``; it runs after every call submitted before it
        (queued events are sent first)."""
        self.flush_events()
        return self._enqueue(self._name(method), args, kwargs)

    def submit_event(self, method: Callable[..., None], *args: Any) -> bool:
        """Queue the event call ``method(endpoint, *args)`` (one of the endpoint's ``EVENT_CALLS``)
        to be sent with the others queued until ``flush_events`` (module docstring, "Events in
        bursts"). Returns whether it is the first since the last flush: the caller arranges that
        flush."""
        name = self._name(method)
        if name not in self._event_calls:
            raise TypeError(f"{name} is not an event call of {type(self.endpoint).__name__} "
                            f"(its EVENT_CALLS: {sorted(self._event_calls)})")
        self._events.append((name, args))
        return len(self._events) == 1

    def flush_events(self) -> None:
        """Send the event calls queued by ``submit_event`` as one message (nothing when none are)."""
        if self._events:
            calls, self._events = self._events, []
            self._enqueue(_EVENTS, (calls,), {})

    def _name(self, method: Callable) -> str:
        name = method.__name__
        if getattr(type(self.endpoint), name, None) is not method:
            raise TypeError(f"{method!r} is not a method of {type(self.endpoint).__name__}")
        return name

    def _enqueue(self, name: str, args: tuple, kwargs: dict[str, Any]) -> concurrent.futures.Future:
        with self._lock:
            self._num_submitted += 1
            self._submitted.notify_all()
        future = self._pool.submit(self._run, name, args, kwargs)
        with self._lock:
            self._queued.add(future)
        future.add_done_callback(self._forget)
        return future

    def control(self, name: str, *args: Any) -> concurrent.futures.Future[None]:
        """Every rank runs ``controls[name](*args)`` when it receives this message, after the calls
        submitted before it. Not a call: it changes no call's ``more_queued``."""
        if name not in self.controls:
            raise ValueError(f"no learner control {name!r} (installed: {sorted(self.controls)})")
        self.flush_events()
        self._wake()
        return self._pool.submit(self._run, _CONTROL, (name, *args), {})

    def _wake(self) -> None:
        """A message that is not a call is queued: an event's pack window ends (the event is not
        told more is queued; its work runs before the message)."""
        with self._lock:
            self._num_wakes += 1
            self._submitted.notify_all()

    def _packing(self) -> bool:
        """Does the endpoint hold work for ``ready_work`` now (the pack window waits only then)?"""
        packing = getattr(self.endpoint, "packing", None)
        return bool(packing()) if packing is not None else False

    def _wait_for_next_call(self) -> bool:
        """(``_lock`` held) An event's pack window (``PackWindow.wait``): whether the next call arrived."""
        wakes = self._num_wakes

        def arrived() -> bool:
            return self._num_submitted > self._num_started

        def ended() -> bool:
            return arrived() or self._num_wakes != wakes

        return self.window.wait(self._submitted, arrived, ended)

    def _on_hang(self) -> None:
        if self.on_hang is not None:
            self.on_hang()

    def _forget(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._queued.discard(future)

    async def call(self, method: Callable[Concatenate[E, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.wrap_future(self.submit(method, *args, **kwargs))

    def stop(self, cancel_pending: bool = False) -> None:
        """Stop every rank's service after the calls submitted so far (``cancel_pending``: after
        the call running now; the rest are dropped)."""
        self.flush_events()
        self._wake()
        if cancel_pending:  # queued calls never reach any rank: the ranks stay in step
            with self._lock:
                queued = list(self._queued)
            for future in queued:
                future.cancel()
        if self._watchdog is not None and self._watchdog.fired.is_set():
            # The learner thread is stuck in a collective; the watchdog ends the process.
            time.sleep(2 * CLEANUP_S)
            os._exit(LEARNER_HUNG)
        if self.world_size > 1:
            try:
                self._pool.submit(self._run, _STOP, (), {}).result()
            except LearnerRankLost:
                pass  # already reported by the call that found it
            if self._watchdog is not None:
                self._watchdog.stop()
            self._beats.stop()
        self._pool.shutdown(wait=True)

    @property
    def _beats(self) -> Heartbeat:
        """The heartbeat, which every rank of a world of more than one process runs."""
        assert self._heartbeat is not None, "no heartbeat in a single-process world"
        return self._heartbeat

    def _broadcast(self, msg: Any) -> Any:
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _run(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        is_call = method not in (_STOP, _CONTROL)
        more = False
        if is_call:
            with self._lock:
                self._num_started += 1
                more = self._num_submitted > self._num_started  # calls queued behind this one
                last = args[0][-1][0] if method == _EVENTS else method  # the others have more queued
                window = last in self._window_calls
                if not more and self.window.open and window and self._packing():
                    more = self._wait_for_next_call()
        if method == _CONTROL and self.world_size == 1:
            return self._controlled(args)
        if self.world_size == 1:
            return self._execute(method, args, kwargs, more)
        name = {_STOP: "stop", _CONTROL: f"control {args}", _EVENTS: "events"}.get(method, method)
        self._in_flight = InFlight(self._num_calls + 1, name, time.monotonic(), is_call)
        try:
            self._broadcast((method, args, kwargs, more))
            if method == _CONTROL:
                return self._controlled(args)
            return self._execute(method, args, kwargs, more) if is_call else None
        except RuntimeError as err:  # gloo: a peer closed its connection or timed out
            silent = self._beats.silent_ranks()
            if not silent:
                raise  # every rank is alive: a real error of the call itself
            who = ", ".join(f"rank {r} (silent {age:.0f} s)" for r, age in silent)
            raise LearnerRankLost(
                f"learner call '{method}' failed: {who} stopped responding; the run stops now and "
                f"resumes from its last checkpoint when restarted ({str(err).splitlines()[0][:200]})"
            ) from err
        finally:
            self._in_flight = None

    def _execute(self, method: str, args: tuple, kwargs: dict[str, Any], more_queued: bool = False) -> Any:
        if method == _EVENTS:  # each as its own call, all but the last with more queued behind it
            (calls,) = args
            for k, (name, call_args) in enumerate(calls):
                self._execute(name, call_args, {}, more_queued or k + 1 < len(calls))
            return None
        start = time.monotonic()
        ready_work = getattr(self.endpoint, "ready_work", None)
        self._num_calls += 1
        index = self._num_calls
        if self._heartbeat is not None:  # the step loop's own beat: this rank is in call ``index``
            self._heartbeat.call_started(index, method)
        try:
            if ready_work is not None:
                self.endpoint.more_queued = more_queued  # type: ignore[attr-defined]
            result = getattr(self.endpoint, method)(*args, **kwargs)
            if ready_work is not None and not more_queued:
                ready_work()
            return result
        finally:
            if self._heartbeat is not None:  # finished (or raised): the step loop moved on
                self._heartbeat.call_finished(index, method)
            with self._lock:
                self.spans.append(Span(method, start, time.monotonic(), self.step_index))

    def _controlled(self, message: tuple) -> None:
        name, *args = message
        self.controls[name](*args)

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
            if method == _CONTROL:
                self._controlled(args)
                continue
            self._execute(method, args, kwargs, more)

    def forget_spans_before(self, step: int) -> None:
        """Drop the spans of optimizer steps before ``step`` (the timeline keeps a window). Spans
        are appended in step order, so they go from the front: no pass over the window each step."""
        with self._lock:
            drop_front(self.spans, lambda s: s.step < step)

    def busy_seconds(self, since: float, until: float, kinds: set[str] | None = None) -> float:
        """Seconds of calls (of ``kinds``) inside [since, until]. Spans are appended as calls end, so
        in order of their ends: the scan goes back from the newest and stops at the first that
        ended by ``since`` (a run's window of spans is not read each step)."""
        total = 0.0
        with self._lock:
            for s in reversed(self.spans):
                if s.end <= since:
                    break
                if kinds is None or s.kind in kinds:
                    total += max(0.0, min(s.end, until) - max(s.start, since))
        return total
