"""Is every learner rank alive and moving? Heartbeats, step-loop beats, and rank 0's watchdog.

Two kinds of beat reach the job's store (the default process group's: torchrun's or our
rendezvous'), one key each per rank:

    megathunder/alive/<rank>  a heartbeat thread's stamp, every HEARTBEAT_S: the process runs
    megathunder/call/<rank>   "<started> <finished> <method>", written by the service's call path
                              (not a thread) as each learner call starts and ends: the step loop moves

A dead rank is found by gloo itself (a peer's closed socket fails the next collective within a
second); the heartbeats then name it (``Heartbeat.silent_ranks``). A rank that *hangs* fails
nothing: a SIGSTOPped process keeps its sockets open, and a rank wedged inside its step keeps
beating from its heartbeat thread, so rank 0 would wait in the next collective until gloo's
process-group timeout (30 minutes). Rank 0's :class:`Watchdog` reads both beats every
HEARTBEAT_S and, while a learner call is in flight, names

- ranks whose heartbeat has not changed for ``heartbeat_timeout_s`` (stopped or frozen: the
  heartbeat thread stops with the process), and
- when the call has been in flight for over ``call_timeout_s`` (0: never), the ranks that have not
  finished it, with the call each is in and for how long (heartbeat alive: wedged in the step).

A thread cannot interrupt a gloo collective, so the watchdog ends the process: one line on
stderr, a bounded clean-up (``on_hang``: the trainer closes its rollout engine), this process's
``multiprocessing`` children ended (``os._exit`` skips the exit hook that would: Megatron's
checkpoint-queue manager would outlive the run), then ``os._exit(LEARNER_HUNG)``. Checkpoints are
written atomically, so the same command resumes.

Ages are measured on rank 0's monotonic clock, from when rank 0 saw a key change, never by
comparing clocks of different hosts.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
LEARNER_HUNG = 86
"""Exit status of a run whose rank 0 found a hung learner rank (the same command resumes)."""
CLEANUP_S = 30.0
"""How long the watchdog lets ``on_hang`` clean up (close the rollout engine) before it exits."""
STOPS_RESUMABLY = "the run stops now and resumes from its last checkpoint when restarted"


def alive_key(rank: int) -> str:
    return f"megathunder/alive/{rank}"


def call_key(rank: int) -> str:
    return f"megathunder/call/{rank}"


class Heartbeat:
    """Each rank stamps ``megathunder/alive/<rank>`` in the store every HEARTBEAT_S (a thread), and
    ``megathunder/call/<rank>`` as each learner call starts and ends (the caller's thread)."""

    def __init__(self, rank: int, world_size: int) -> None:
        # The default group's store (torchrun's / our rendezvous'): private but long-stable API.
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.world_size = rank, world_size
        self._stop = threading.Event()
        self._beat()
        self._set_call(0, 0, "-")
        threading.Thread(target=self._loop, name="heartbeat", daemon=True).start()

    def _beat(self) -> None:
        self.store.set(alive_key(self.rank), repr(time.time()))

    def _loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except Exception:  # the store is gone with rank 0: the collectives report it
                return

    def _set_call(self, started: int, finished: int, method: str) -> None:
        try:
            self.store.set(call_key(self.rank), f"{started} {finished} {method}")
        except Exception:  # the store is gone with rank 0: the next collective reports it
            pass

    def call_started(self, index: int, method: str) -> None:
        self._set_call(index, index - 1, method)

    def call_finished(self, index: int, method: str) -> None:
        self._set_call(index, index, method)

    def silent_ranks(self) -> list[tuple[int, float]]:
        """(rank, seconds since its last heartbeat) for ranks silent for over 2.5 beats."""
        time.sleep(2.5 * HEARTBEAT_S)
        out: list[tuple[int, float]] = []
        now = time.time()
        for r in range(self.world_size):
            key = alive_key(r)
            age = now - float(self.store.get(key)) if self.store.check([key]) else float("inf")
            if age > 2.5 * HEARTBEAT_S:
                out.append((r, age))
        return out

    def stop(self) -> None:
        self._stop.set()


@dataclass
class InFlight:
    """Rank 0's learner call in flight: its index (the same on every rank), method, start."""

    index: int
    method: str
    since: float  # time.monotonic()
    is_call: bool = True  # False for the service's own messages (stop, a chaos fault): no step to finish


@dataclass
class _Seen:
    """What rank 0 last read of one rank's keys, and when (its monotonic clock) each last changed."""

    alive: bytes = b""
    alive_changed: float = 0.0
    started: int = 0
    finished: int = 0
    method: str = "-"
    started_at: float = 0.0


class Watchdog:
    """Rank 0's thread: ends the run with one line when a learner rank hangs (module docstring)."""

    def __init__(self, heartbeat: Heartbeat, in_flight: Callable[[], InFlight | None],
                 heartbeat_timeout_s: float, call_timeout_s: float,
                 on_hang: Callable[[], None] = lambda: None) -> None:
        self.store, self.world_size = heartbeat.store, heartbeat.world_size
        self.in_flight, self.on_hang = in_flight, on_hang
        self.heartbeat_timeout_s, self.call_timeout_s = heartbeat_timeout_s, call_timeout_s
        self.fired = threading.Event()
        self._stop = threading.Event()
        now = time.monotonic()
        self._seen = {r: _Seen(alive_changed=now, started_at=now) for r in range(1, self.world_size)}
        threading.Thread(target=self._loop, name="learner-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        warned = False
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._read()
            except Exception as err:  # a store that failed once may answer next time: keep watching
                if not warned and not self._stop.is_set():
                    log.warning("learner watchdog: reading the ranks' beats failed (%s); retrying every %g s",
                                str(err).splitlines()[0][:200] if str(err) else type(err).__name__, HEARTBEAT_S)
                    warned = True
                continue
            flight = self.in_flight()
            if flight is None or self._stop.is_set():
                continue
            verdict = self.verdict(flight, time.monotonic())
            if verdict is not None:
                self._end(verdict)
                return

    def _read(self) -> None:
        ranks = list(self._seen)
        keys = [k for r in ranks for k in (alive_key(r), call_key(r))]
        if self.store.check(keys):
            values = dict(zip(keys, self.store.multi_get(keys)))
        else:  # a rank whose heartbeat has not started yet
            values = {k: self.store.get(k) for k in keys if self.store.check([k])}
        now = time.monotonic()
        for r in ranks:
            seen = self._seen[r]
            alive = values.get(alive_key(r))
            if alive is not None and alive != seen.alive:
                seen.alive, seen.alive_changed = alive, now
            call = values.get(call_key(r))
            if call is not None:
                started, finished, method = call.decode().split(" ", 2)
                if int(started) != seen.started:
                    seen.started_at = now
                seen.started, seen.finished, seen.method = int(started), int(finished), method

    def verdict(self, flight: InFlight, now: float) -> str | None:
        """The one line naming the hung ranks, or None while every rank looks alive and moving."""
        what = f"learner call {flight.index} ('{flight.method}')" if flight.is_call else f"learner '{flight.method}'"
        head = f"{what}, in flight for {now - flight.since:.1f} s"
        silent = [(r, now - s.alive_changed) for r, s in self._seen.items()
                  if now - s.alive_changed > self.heartbeat_timeout_s]
        if silent:
            who = ", ".join(f"rank {r} hung (no heartbeat for {age:.1f} s, bound {self.heartbeat_timeout_s:g} s: "
                            "the process is stopped or frozen)" for r, age in silent)
            return f"{head}: {who}; {STOPS_RESUMABLY}"
        if not flight.is_call or not self.call_timeout_s or now - flight.since <= self.call_timeout_s:
            return None
        behind = [(r, s) for r, s in self._seen.items() if s.finished < flight.index]
        bound = f"bound {self.call_timeout_s:g} s"
        if not behind:  # every other rank finished it: rank 0 itself is wedged in the call
            who = f"rank 0 hung (every other rank finished the call; {bound})"
        else:
            who = ", ".join(f"rank {r} hung ({_where(s, now)}, heartbeat alive: wedged in its step, or waiting in "
                            f"a collective for a rank that is; {bound})" for r, s in behind)
        return f"{head}: {who}; {STOPS_RESUMABLY}"

    def _end(self, message: str) -> None:
        """One line, a bounded clean-up, and the process ends (a gloo collective cannot be interrupted)."""
        self.fired.set()
        print(f"megathunder: {message}", file=sys.stderr, flush=True)
        cleanup = threading.Thread(target=self.on_hang, name="learner-hang-cleanup", daemon=True)
        cleanup.start()
        cleanup.join(CLEANUP_S)
        end_children()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(LEARNER_HUNG)


def end_children(grace_s: float = 5.0) -> None:
    """End this process's ``multiprocessing`` children: SIGTERM, then SIGKILL after ``grace_s``."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join(grace_s)


def _where(seen: _Seen, now: float) -> str:
    if seen.started > seen.finished:
        return f"in call {seen.started} ('{seen.method}') for {now - seen.started_at:.1f} s"
    return f"finished call {seen.finished}, not started the next"
