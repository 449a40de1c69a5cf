"""Least-outstanding-requests load balancing over rollout servers.

Agentic rollouts have long-tailed lengths, so request counts per server drift apart quickly under
round-robin; routing each request to the server with the fewest requests still in flight keeps
queues even. Ties go round-robin so an idle pool spreads its first requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class LeastOutstandingBalancer:
    def __init__(self, num_servers: int) -> None:
        if num_servers < 1:
            raise ValueError("num_servers must be >= 1")
        self.outstanding = [0] * num_servers
        self.num_routed = [0] * num_servers
        self._next = 0

    def acquire(self) -> int:
        """The server for the next request (its outstanding count is incremented)."""
        n = len(self.outstanding)
        order = [(self._next + k) % n for k in range(n)]
        server = min(order, key=lambda i: self.outstanding[i])
        self._next = (server + 1) % n
        self.outstanding[server] += 1
        self.num_routed[server] += 1
        return server

    def release(self, server: int) -> None:
        if self.outstanding[server] <= 0:
            raise RuntimeError(f"server {server} released more often than acquired")
        self.outstanding[server] -= 1

    @contextmanager
    def route(self) -> Iterator[int]:
        server = self.acquire()
        try:
            yield server
        finally:
            self.release(server)
