"""The controller's view of its sandbox servers: where each new sandbox goes, and which servers are
lost (``remote.py`` runs sandboxes on them).

**Placement.** A new sandbox goes to the live server with the fewest of this controller's open
sandboxes relative to its capacity (its ``/health``'s ``max_sandboxes``), lowest index on a tie;
with every live server full, it waits for a slot. A server that refuses at its bound (another
controller's sandboxes fill it) is skipped for that placement.

**Lost servers.** A server is lost when a request to it fails to connect (or is cut off) and its
``/health`` then does not answer, when it says it is shutting down, or -- by progress, not only
by ``/health`` -- when a request stays unanswered past its bound: the server enforces each
command's wall-time limit itself, so an ``exec`` must answer within that limit plus
``sandbox.hang_grace_s`` (a create within ``create_timeout_s`` plus it). A hung server's other
requests in flight are cancelled at once. A lost server gets no further request: each request to
it raises :class:`ServerLost`, which ``remote.py`` answers by re-running the sandbox elsewhere. A
connection dropped by a server whose ``/health`` answers is sent again (at most
:data:`MAX_DROPPED` times); an ``exec`` carries a request id, so a command is never run twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from megathunder.config import RemoteSandboxConfig
from megathunder.rollout.engines.auth import read_api_key
from megathunder.rollout.sandbox.core import SandboxError
from megathunder.rollout.sandbox.discovery import server_urls

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 5.0
MAX_DROPPED = 3
OVER_BOUND_RETRY_S = 0.5


class ServerLost(Exception):
    """The server is gone or hung: whatever it held must be re-run elsewhere."""


class SandboxGone(Exception):
    """The server is alive but no longer has the sandbox (it was restarted, or destroyed it)."""


class OverBound(Exception):
    """The server refused a create at its bound."""


@dataclass
class Server:
    index: int
    url: str
    capacity: int = 0  # its max_sandboxes
    open: int = 0  # this controller's sandboxes on it now (placed)
    episodes: int = 0  # sandboxes this controller created on it
    lost: str | None = None  # why it is lost
    in_flight: set[asyncio.Future] = field(default_factory=set)


class SandboxServers:
    """The servers of one controller (one per event loop and config: :func:`servers_for`)."""

    def __init__(self, cfg: RemoteSandboxConfig, urls: list[str], session: Any) -> None:
        self.cfg, self.session = cfg, session
        self.servers = [Server(i, u.rstrip("/")) for i, u in enumerate(urls)]
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self.num_failovers = 0  # sandboxes re-run on another server
        self.num_replayed = 0  # commands replayed there
        self._changed = asyncio.Event()  # a slot freed or a server lost
        self._background: set[asyncio.Future] = set()

    @classmethod
    async def connect(cls, cfg: RemoteSandboxConfig) -> SandboxServers:
        """Find the servers, read each one's capacity (``/health``) and check the secret; servers that
        do not answer are lost from the start (a warning names them), none answering is an error."""
        import aiohttp

        try:
            key = read_api_key(cfg.api_key_env, "sandbox.api_key_env")
        except RuntimeError as err:
            raise SandboxError(str(err)) from None
        urls = server_urls(cfg)
        session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
            headers=None if key is None else {"Authorization": f"Bearer {key}"})
        pool = cls(cfg, urls, session)
        try:
            await asyncio.gather(*(pool._check(s) for s in pool.servers))
        except BaseException:
            await session.close()
            raise
        if not pool.live:
            await session.close()
            raise SandboxError("no sandbox server answers: " + "; ".join(f"{s.url} ({s.lost})" for s in pool.servers))
        return pool

    async def _check(self, server: Server) -> None:
        import aiohttp

        try:
            async with self.session.get(f"{server.url}/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                health = await r.json(content_type=None) if r.status == 200 else None
            async with self.session.get(f"{server.url}/metrics", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                status = r.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            self.lose(server, f"does not answer at start: {type(err).__name__}: {err}")
            return
        if status == 401:
            raise SandboxError(f"sandbox server {server.url} refused this controller's token (sandbox.api_key_env "
                               "must name the secret the servers were started with)")
        if health is None or health.get("status") != "ok":
            self.lose(server, f"not healthy at start ({health})")
            return
        server.capacity = int(health["max_sandboxes"])

    @property
    def live(self) -> list[Server]:
        return [s for s in self.servers if s.lost is None]

    @property
    def capacity(self) -> int:
        return sum(s.capacity for s in self.live)

    def lose(self, server: Server, why: str) -> None:
        if server.lost is not None:
            return
        server.lost = why
        log.warning("sandbox server %s lost (%s); %d of %d left; its sandboxes are re-run on them",
                    server.url, why, len(self.live), len(self.servers))
        for request in list(server.in_flight):
            request.cancel()
        self._changed.set()

    # ------------------------------------------------------------------ placement

    async def place(self, refused: set[int] | None = None) -> Server:
        """A slot on the least loaded live server (``refused``: skip these); waits while all are full."""
        refused = refused or set()
        while True:
            live = self.live
            if not live:
                lost = "; ".join(f"{s.url} ({s.lost})" for s in self.servers)
                raise SandboxError(f"no live sandbox server left: lost {lost}")
            free = [s for s in live if s.open < s.capacity and s.index not in refused]
            if free:
                best = min(free, key=lambda s: (s.open / s.capacity, s.open, s.index))
                best.open += 1
                return best
            if refused and all(s.index in refused for s in live):  # every one said it is full
                await asyncio.sleep(OVER_BOUND_RETRY_S)
                refused.clear()
                continue
            self._changed.clear()
            await self._changed.wait()

    def release(self, server: Server) -> None:
        server.open -= 1
        self._changed.set()

    # ------------------------------------------------------------------ requests

    async def call(self, server: Server, method: str, path: str, *, bound_s: float, **kwargs: Any) -> Any:
        """``method path`` on ``server``: its JSON answer (bytes for an archive). Raises
        :class:`ServerLost`, :class:`SandboxGone`, :class:`OverBound`, or :class:`SandboxError` for
        an error of the sandbox itself (the server's message)."""
        import aiohttp

        dropped = 0
        while True:
            if server.lost is not None:
                raise ServerLost(f"{server.url}: {server.lost}")
            inner = asyncio.ensure_future(self._http(server, method, path, **kwargs))
            server.in_flight.add(inner)
            try:
                done, _ = await asyncio.wait({inner}, timeout=bound_s)
                if not done:
                    inner.cancel()
                    self.lose(server, f"hung: no answer to {method} {path.split('?')[0]} in {bound_s:g} s")
                    raise ServerLost(f"{server.url}: {server.lost}")
                return inner.result()
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if server.lost is not None and inner.cancelled() and not (me is not None and me.cancelling()):
                    raise ServerLost(f"{server.url}: {server.lost}") from None  # lost while we waited
                inner.cancel()
                raise
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:
                if not await self.healthy(server):
                    self.lose(server, f"{type(err).__name__}: {err}; /health does not answer")
                    raise ServerLost(f"{server.url}: {server.lost}") from None
                dropped += 1
                if dropped >= MAX_DROPPED:
                    raise SandboxError(f"{method} {server.url}{path}: connection dropped {dropped} times by a live "
                                       f"sandbox server ({type(err).__name__}: {err})") from err
            finally:
                server.in_flight.discard(inner)

    async def _http(self, server: Server, method: str, path: str, **kwargs: Any) -> Any:
        async with self.session.request(method, server.url + path, **kwargs) as r:
            if r.status in (200, 201):
                if r.content_type == "application/x-tar":
                    return await r.read()
                return await r.json(content_type=None)
            try:
                answer = await r.json(content_type=None)
                kind, message = answer.get("kind"), answer.get("error")
            except ValueError:
                kind, message = None, (await r.text())[:500]
        where = f"sandbox server {server.url}"
        if kind in ("unknown_sandbox", "destroyed", "cancelled"):
            raise SandboxGone(f"{where}: {message}")
        if kind == "over_bound":
            raise OverBound(f"{where}: {message}")
        if kind == "shutting_down":
            self.lose(server, "shutting down")
            raise ServerLost(f"{where}: shutting down")
        raise SandboxError(f"{where}: {message} ({method} {path.split('?')[0]} -> {r.status})")

    async def healthy(self, server: Server) -> bool:
        import aiohttp

        try:
            async with self.session.get(f"{server.url}/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    def background(self, work: asyncio.Future) -> None:
        """Keep ``work`` (a clean-up that outlives its caller) until it ends; :meth:`close` awaits it."""
        self._background.add(work)
        work.add_done_callback(self._background.discard)

    def stats(self) -> dict[str, Any]:
        return {"servers": {s.url: {"open": s.open, "episodes": s.episodes, "capacity": s.capacity, "lost": s.lost}
                            for s in self.servers},
                "failovers": self.num_failovers, "replayed_commands": self.num_replayed}

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=self.cfg.hang_grace_s)
        await self.session.close()


# ---------------------------------------------------------------------- one pool per loop and config

_pools: dict[tuple[int, str], asyncio.Future[SandboxServers]] = {}


async def servers_for(cfg: RemoteSandboxConfig) -> SandboxServers:
    """This event loop's pool for ``cfg`` (connected on first use; a failed connect is retried next time)."""
    key = (id(asyncio.get_running_loop()), cfg.model_dump_json())
    pending = _pools.get(key)
    if pending is None:
        pending = _pools[key] = asyncio.ensure_future(SandboxServers.connect(cfg))
    try:
        return await asyncio.shield(pending)
    except BaseException:
        if pending.done() and (pending.cancelled() or pending.exception() is not None):
            _pools.pop(key, None)
        raise


async def close_pools() -> None:
    """Close this event loop's pools (their HTTP sessions); the servers keep running."""
    loop = id(asyncio.get_running_loop())
    for key in [k for k in _pools if k[0] == loop]:
        pending = _pools.pop(key)
        if pending.done() and not pending.cancelled() and pending.exception() is None:
            await pending.result().close()
        else:
            pending.cancel()


def pools() -> list[SandboxServers]:
    """This event loop's connected pools (stats in tests and benchmarks)."""
    loop = id(asyncio.get_running_loop())
    return [p.result() for k, p in _pools.items()
            if k[0] == loop and p.done() and not p.cancelled() and p.exception() is None]


__all__ = ["OverBound", "SandboxGone", "SandboxServers", "Server", "ServerLost", "close_pools", "pools",
           "servers_for"]
