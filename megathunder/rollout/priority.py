"""Request priorities for vLLM's priority scheduling (``rollout.engine.scheduling``).

vLLM serves the waiting request with the lowest ``(priority, arrival time)`` first and, when the
KV cache is full, preempts the running request with the highest. Under ``fifo`` every request has
priority 0 (arrival order). The other policies give each turn's request, when it is made:

    trajectory_start   s                 the trajectory's start index (0, 1, ... over the run)
    group_aware        r * 2**32 + s     r: members of its group still running (not finished)

So under ``trajectory_start`` an episode that started early keeps its place at every turn (its
tool calls do not send it to the back of the queue) and trajectories finish about in the order
they started; under ``group_aware`` the group nearest to closing goes first, so its last reward --
which the ledger needs to fold the group and free its slot -- comes early, and a group's
stragglers do not wait behind fresh groups. Sampling is unchanged: priorities decide only when a
request is computed, never what it samples (seeded per request).

The simulator models the same policies (``megathunder.simulate``: ``oldest_first`` is
``trajectory_start``).
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Literal

Scheduling = Literal["fifo", "trajectory_start", "group_aware"]
_GROUP_STRIDE = 2**32


class Priorities:
    """One agent loop's episodes, counted as they start and finish; ``of`` gives a turn's priority."""

    def __init__(self, policy: Scheduling = "fifo") -> None:
        self.policy = policy
        self._starts = itertools.count()
        self._start_of: dict[int, int] = {}  # traj_id -> start index
        self._running: Counter[int] = Counter()  # group_id -> members started and not finished

    def started(self, traj_id: int, group_id: int) -> None:
        self._start_of[traj_id] = next(self._starts)
        self._running[group_id] += 1

    def finished(self, traj_id: int, group_id: int) -> None:
        if self._start_of.pop(traj_id, None) is not None:
            self._running[group_id] -= 1
            if self._running[group_id] <= 0:
                del self._running[group_id]

    def of(self, traj_id: int, group_id: int) -> int:
        """The priority of the trajectory's next request (lower is served first)."""
        if self.policy == "fifo":
            return 0
        start = self._start_of[traj_id]
        if self.policy == "trajectory_start":
            return start
        return self._running[group_id] * _GROUP_STRIDE + start
