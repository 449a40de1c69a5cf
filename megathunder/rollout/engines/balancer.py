"""Least-outstanding-requests load balancing over rollout servers, with session affinity.

Agentic rollouts have long-tailed lengths, so request counts per server drift apart quickly under
round-robin; routing each request to the server with the fewest requests still in flight keeps
queues even. Ties go round-robin so an idle pool spreads its first requests.

Multi-turn episodes resend their whole history every turn, which only the server that served the
previous turn holds in its prefix cache. A request with a ``session`` key therefore goes back to
that session's server unless that server has more than ``max_imbalance`` requests in flight above
the least loaded one (then it moves, and the session follows it).

A server found dead (:meth:`mark_dead`) gets no further requests and its sessions move; with no
live server left, :meth:`acquire` raises :class:`NoLiveServerError`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from contextlib import contextmanager


class NoLiveServerError(RuntimeError):
    pass


class LeastOutstandingBalancer:
    def __init__(self, num_servers: int, max_imbalance: int = 4, max_sessions: int = 100_000) -> None:
        if num_servers < 1:
            raise ValueError("num_servers must be >= 1")
        self.outstanding = [0] * num_servers
        self.num_routed = [0] * num_servers
        self.max_imbalance = max_imbalance
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[Hashable, int] = OrderedDict()  # LRU: session -> server
        self._next = 0
        self.dead: set[int] = set()

    @property
    def live(self) -> list[int]:
        return [i for i in range(len(self.outstanding)) if i not in self.dead]

    def mark_dead(self, server: int) -> None:
        self.dead.add(server)
        for session in [s for s, i in self._sessions.items() if i == server]:
            del self._sessions[session]

    def acquire(self, session: Hashable | None = None) -> int:
        """The server for the next request (its outstanding count is incremented)."""
        n = len(self.outstanding)
        order = [(self._next + k) % n for k in range(n) if (self._next + k) % n not in self.dead]
        if not order:
            raise NoLiveServerError(f"all {n} servers are dead")
        server = min(order, key=lambda i: self.outstanding[i])
        self._next = (server + 1) % n
        if session is not None:
            sticky = self._sessions.pop(session, None)
            if sticky is not None and self.outstanding[sticky] <= self.outstanding[server] + self.max_imbalance:
                server = sticky
            self._sessions[session] = server
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        self.outstanding[server] += 1
        self.num_routed[server] += 1
        return server

    def server_of(self, session: Hashable | None) -> int | None:
        """The server a session's last request went to (None: unknown or evicted)."""
        return None if session is None else self._sessions.get(session)

    def release(self, server: int) -> None:
        if self.outstanding[server] <= 0:
            raise RuntimeError(f"server {server} released more often than acquired")
        self.outstanding[server] -= 1

    @contextmanager
    def route(self, session: Hashable | None = None) -> Iterator[int]:
        server = self.acquire(session)
        try:
            yield server
        finally:
            self.release(server)
