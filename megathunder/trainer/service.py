"""The learner as a service: every learner call runs on one worker thread, on every rank.

The controller (global rank 0) lives on an asyncio loop with the rollout side; learner work
(backward passes, optimizer steps, weight gathers) runs on a worker thread so rollouts, tool
calls and verifiers keep going while the learner computes -- that overlap is the point of
streaming. Calls run in submission order, so events reach the ledger in the order they happened.

Across ranks the controller channel is torch.distributed itself: before running a call, rank 0
broadcasts ``(method, args)`` on a gloo group of the learner's world, and every other rank runs
the same call from ``serve()``. We use torch.distributed rather than mpi4py because the learner
already has the group, it works the same under torchrun and Slurm's srun, and nothing else has
to be installed on the cluster. Collectives inside the calls (DP reduce, TP/PP exchange, the
weight gather) then line up on all ranks by construction.

Each call is timed; the spans feed the run's timeline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

_STOP = "__stop__"


@dataclass
class Span:
    kind: str
    start: float  # time.monotonic()
    end: float
    step: int


@dataclass
class LearnerService:
    handlers: dict[str, Callable]
    rank: int = 0
    world_size: int = 1
    spans: list[Span] = field(default_factory=list)
    step: int = 0

    def __post_init__(self) -> None:
        from megathunder.learner import cpu_compat

        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="learner", initializer=cpu_compat.enable_in_this_thread
        )
        self._group = dist.new_group(backend="gloo") if self.world_size > 1 else None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ controller (rank 0)

    def submit(self, method: str, *args) -> concurrent.futures.Future:
        """Queue a call; it runs after every call submitted before it."""
        return self._pool.submit(self._run, method, args)

    async def call(self, method: str, *args):
        return await asyncio.wrap_future(self.submit(method, *args))

    def stop(self) -> None:
        if self.world_size > 1:
            self._pool.submit(self._broadcast, (_STOP, ())).result()
        self._pool.shutdown(wait=True)

    def _broadcast(self, msg):
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _run(self, method: str, args: tuple):
        if self.world_size > 1:
            self._broadcast((method, args))
        return self._execute(method, args)

    def _execute(self, method: str, args: tuple):
        start = time.monotonic()
        try:
            return self.handlers[method](*args)
        finally:
            with self._lock:
                self.spans.append(Span(method, start, time.monotonic(), self.step))

    # ------------------------------------------------------------------ followers (rank > 0)

    def serve(self) -> None:
        """Run rank 0's calls until it stops the service."""
        while True:
            method, args = self._broadcast(None)
            if method == _STOP:
                return
            self._execute(method, args)

    def busy_seconds(self, since: float, until: float, kinds: set[str] | None = None) -> float:
        with self._lock:
            return sum(
                max(0.0, min(s.end, until) - max(s.start, since))
                for s in self.spans if kinds is None or s.kind in kinds
            )
