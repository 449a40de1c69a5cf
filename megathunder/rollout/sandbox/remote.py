"""``sandbox.backend: remote``: an episode's sandbox on a sandbox server, behind the same
:class:`~megathunder.rollout.sandbox.core.Sandbox` interface as the local and container ones (the
agent loop and the tasks do not know where it runs).

The sandbox is created on the least loaded live server (``server_pool.py``) and stays there: every
command, upload and download of the episode -- its tool calls, then its test run -- goes to that
server. Commands are bounded there by their own limits, and here by hang detection.

**A lost server is an infrastructure failure of the sandbox, re-run where it can be.** Every call
that changes the sandbox is journaled here: each command (argv, stdin, limits) with what it
returned, each upload with its archive. When the server is lost (or no longer has the sandbox),
the sandbox is created again on another live server and the journal is replayed there in order;
each replayed command must reproduce what was recorded (``sandbox.replay_check``: its exit code
and time-out, or also its output). Then the call that met the loss runs there, and the episode
goes on as if nothing happened: the model's turns are not generated again, and what it saw stays
what the state it acts on would show. The policy never trains on a transcript the environment did
not produce.

Where the sandbox cannot be re-run -- ``sandbox.max_failovers`` spent, the journal over
``sandbox.max_replay_bytes``, a command cancelled mid-run (its effect is unknown), a replay that
diverges, no live server left -- the call raises :class:`SandboxError` and the sandbox stays
broken: every later call raises too, so its verifier can never score a half-rebuilt state. The
episode then fails with ``verifier.on_infra_failure`` (a benchmark task's group is dropped), never
a reward.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from megathunder.config import RemoteSandboxConfig
from megathunder.rollout.sandbox import protocol
from megathunder.rollout.sandbox.core import CommandLimits, Environment, ExecResult, Sandbox, SandboxError
from megathunder.rollout.sandbox.server_pool import (
    OverBound,
    SandboxGone,
    SandboxServers,
    Server,
    ServerLost,
    servers_for,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Entry:
    """One recorded call: a command (``body``: what was sent, ``stdin`` apart) or an upload."""

    kind: str  # "exec" | "upload"
    body: dict[str, Any]
    stdin: bytes | None
    wall_s: float
    exit_code: int | None = None
    timed_out: bool = False
    digest: str | None = None  # of the output (replay_check: output)


class Journal:
    """What a re-run replays, or why there can be none."""

    def __init__(self, max_bytes: int) -> None:
        self.entries: list[Entry] = []
        self.max_bytes, self.num_bytes = max_bytes, 0
        self.unreplayable: str | None = None

    def add(self, entry: Entry) -> None:
        if self.unreplayable is not None:
            return
        self.num_bytes += len(entry.stdin or b"")
        if self.num_bytes > self.max_bytes:
            self.poison(f"its recorded input exceeds sandbox.max_replay_bytes={self.max_bytes}")
            return
        self.entries.append(entry)

    def poison(self, why: str) -> None:
        if self.unreplayable is None:
            self.unreplayable = why
            self.entries.clear()


def _digest(output: str) -> str:
    return hashlib.sha256(output.encode(errors="surrogateescape")).hexdigest()


class RemoteSandbox(Sandbox):
    """One episode's sandbox on a sandbox server; created with :meth:`start`."""

    def __init__(self, servers: SandboxServers, cfg: RemoteSandboxConfig, image: str | None,
                 environment: Environment | None = None) -> None:
        self.servers, self.cfg, self.image, self.environment = servers, cfg, image, environment
        self.limits = {k: getattr(cfg.runtime, k) for k in protocol.LIMIT_FIELDS if hasattr(cfg.runtime, k)}
        self.journal = Journal(cfg.max_replay_bytes)
        self.server: Server | None = None
        self.sid: str | None = None
        self.placements: list[str] = []  # the servers it lived on, in order
        self.num_failovers = 0
        self.workdir = "/"
        self._broken: str | None = None
        self._closed = False

    # ------------------------------------------------------------------ life

    async def start(self) -> RemoteSandbox:
        await self._create()
        return self

    async def _create(self) -> None:
        """Create it on the least loaded live server (another one when a server is lost meanwhile)."""
        body = {"image": self.image, "environment": protocol.environment_to_json(self.environment),
                "limits": self.limits, "owner": self.servers.owner}
        refused: set[int] = set()
        while True:
            server = await self.servers.place(refused)
            request = asyncio.ensure_future(self.servers.call(
                server, "POST", "/sandboxes", json=body, bound_s=self.cfg.create_timeout_s + self.cfg.hang_grace_s))
            try:
                out = await asyncio.shield(request)
            except OverBound:
                self.servers.release(server)
                refused.add(server.index)
                continue
            except ServerLost:
                self.servers.release(server)
                continue
            except asyncio.CancelledError:  # the sandbox may be created after all: destroy it then
                self.servers.background(asyncio.ensure_future(self._discard(server, request)))
                raise
            except BaseException:
                self.servers.release(server)
                raise
            self.server, self.sid = server, out["id"]
            self.workdir, self.tmp_dir = out["workdir"], out["tmp_dir"]
            server.episodes += 1
            self.placements.append(server.url)
            return

    async def _discard(self, server: Server, request: asyncio.Future) -> None:
        try:
            out = await request
            await self.servers.call(server, "DELETE", f"/sandboxes/{out['id']}", bound_s=self.cfg.hang_grace_s)
        except (Exception, asyncio.CancelledError):  # noqa: BLE001 -- best effort; the server reaps idle ones
            pass
        finally:
            self.servers.release(server)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        server, sid = self.server, self.sid
        self.server = self.sid = None
        if server is None:
            return
        try:
            if server.lost is None and sid is not None:
                await asyncio.shield(self.servers.call(server, "DELETE", f"/sandboxes/{sid}",
                                                       bound_s=self.cfg.hang_grace_s))
        except (ServerLost, SandboxGone, SandboxError) as err:
            log.info("remote sandbox %s: not destroyed on %s: %s", sid, server.url, err)
        finally:
            self.servers.release(server)

    def _usable(self) -> Server:
        if self._closed:
            raise SandboxError("sandbox is closed")
        if self._broken is not None:
            raise SandboxError(self._broken)
        assert self.server is not None  # started
        return self.server

    # ------------------------------------------------------------------ calls

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        max_output_bytes: int | None = None,
        limits: CommandLimits | None = None,
    ) -> ExecResult:
        self._usable()
        wall = limits.wall_time_s if limits is not None else timeout_s or self.cfg.runtime.wall_time_s
        body = {"argv": list(argv), "timeout_s": timeout_s, "max_output_bytes": max_output_bytes,
                "limits": protocol.limits_to_json(limits)}
        try:
            result = await self._surviving(lambda: self._exec_once(body, stdin, wall))
        except asyncio.CancelledError:
            self.journal.poison(f"a command was cancelled mid-run ({argv[0]!r}): its effect is unknown")
            raise
        self.journal.add(Entry("exec", body, stdin, wall, result.exit_code, result.timed_out,
                               _digest(result.output) if self.cfg.replay_check == "output" else None))
        return result

    async def _exec_once(self, body: dict[str, Any], stdin: bytes | None, wall: float) -> ExecResult:
        server, sid = self._usable(), self.sid
        request_id = uuid.uuid4().hex
        payload = {**body, "request_id": request_id, "stdin_b64": protocol.bytes_to_json(stdin)}
        try:
            out = await self.servers.call(server, "POST", f"/sandboxes/{sid}/exec", json=payload,
                                          bound_s=wall + self.cfg.hang_grace_s)
        except asyncio.CancelledError:  # the episode's deadline: kill the command on the server too
            if server.lost is None:
                cancel = self.servers.call(server, "POST", f"/sandboxes/{sid}/cancel",
                                           json={"request_id": request_id}, bound_s=self.cfg.hang_grace_s)
                self.servers.background(asyncio.ensure_future(_quietly(cancel)))
            raise
        return protocol.result_from_json(out)

    async def upload_tar(self, archive: bytes, num_files: int | None = None) -> None:
        self._usable()
        await self._surviving(lambda: self._upload_once(archive))
        self.journal.add(Entry("upload", {}, archive, self.cfg.hang_grace_s))

    async def _upload_once(self, archive: bytes) -> None:
        server = self._usable()
        await self.servers.call(server, "PUT", f"/sandboxes/{self.sid}/files", data=archive,
                                headers={"Content-Type": "application/x-tar"},
                                bound_s=self.cfg.runtime.wall_time_s + self.cfg.hang_grace_s)

    async def download(self, path: str, max_bytes: int = 64 << 20) -> bytes:
        self._usable()

        async def once() -> bytes:
            server = self._usable()
            return await self.servers.call(server, "GET", f"/sandboxes/{self.sid}/files",
                                           params={"path": path, "max_bytes": str(max_bytes)},
                                           bound_s=self.cfg.runtime.wall_time_s + self.cfg.hang_grace_s)

        return await self._surviving(once)

    # ------------------------------------------------------------------ failover

    async def _surviving(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call`` on the sandbox's server; when the server (or the sandbox on it) is lost, the
        sandbox is re-run elsewhere and ``call`` sent there."""
        while True:
            try:
                return await call()
            except (ServerLost, SandboxGone) as lost:
                await self._rerun(str(lost))

    async def _rerun(self, why: str) -> None:
        """Create the sandbox on another server and replay its journal there (see the module)."""
        while True:
            old = self.server
            where = old.url if old is not None else "?"
            if self.num_failovers >= self.cfg.max_failovers:
                self._break(f"sandbox lost ({why}); already re-run {self.num_failovers} times "
                            "(sandbox.max_failovers)")
            if self.journal.unreplayable is not None:
                self._break(f"sandbox lost ({why}); it cannot be re-run elsewhere: {self.journal.unreplayable}")
            self.num_failovers += 1
            self.servers.num_failovers += 1
            log.warning("remote sandbox %s on %s lost (%s): re-running its %d recorded calls elsewhere",
                        self.sid, where, why, len(self.journal.entries))
            if old is not None:
                self.servers.release(old)
            self.server = self.sid = None
            try:
                await self._create()
                await self._replay()
                return
            except (ServerLost, SandboxGone) as again:
                why = str(again)
            except SandboxError as err:
                self._break(f"sandbox lost ({why}); its re-run failed: {err}")
            except asyncio.CancelledError:
                self._broken = f"sandbox lost ({why}); its re-run was cancelled"
                raise

    async def _replay(self) -> None:
        for k, entry in enumerate(self.journal.entries):
            if entry.kind == "upload":
                assert entry.stdin is not None
                await self._upload_once(entry.stdin)
            else:
                got = await self._exec_once(entry.body, entry.stdin, entry.wall_s)
                same = (got.exit_code, got.timed_out) == (entry.exit_code, entry.timed_out)
                if same and entry.digest is not None:
                    same = _digest(got.output) == entry.digest
                if not same:
                    assert self.server is not None
                    raise SandboxError(f"replay diverged on {self.server.url} at call {k + 1} "
                                       f"({entry.body['argv'][:3]}): exit {entry.exit_code} then {got.exit_code}"
                                       + (" (output differs)" if got.exit_code == entry.exit_code else ""))
            self.servers.num_replayed += 1

    def _break(self, why: str) -> None:
        """The sandbox cannot be used again: this call and every later one raise."""
        self._broken = why
        raise SandboxError(why)


async def _quietly(call: Awaitable[Any]) -> None:
    try:
        await call
    except (Exception, asyncio.CancelledError):  # noqa: BLE001 -- best effort
        pass


async def create_remote(cfg: RemoteSandboxConfig, image: str | None, environment: Environment | None) -> RemoteSandbox:
    """A started sandbox on this loop's servers of ``cfg`` (``build_sandbox`` for ``backend: remote``)."""
    return await RemoteSandbox(await servers_for(cfg), cfg, image, environment).start()


__all__ = ["Entry", "Journal", "RemoteSandbox", "create_remote"]
