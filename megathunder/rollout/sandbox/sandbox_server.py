"""``megathunder sandbox serve``: a sandbox server, one per rollout or CPU node (the protocol:
``protocol.py``; its client: ``remote.py``).

It creates sandboxes of the config's ``sandbox.runtime`` (local namespaces, docker, podman,
apptainer, enroot) on request, runs commands in them, copies files in and out, and destroys them.

- **Bound**: at most ``sandbox.max_sandboxes_per_server`` open at once; one more is refused (429,
  naming the bound), never queued: the client places its episodes within the servers' bounds.
- **Limits per sandbox**: each create asks for its sandbox's limits (the client's copy of
  ``sandbox.runtime``); the server caps what its node must hold (memory, processes, CPUs, /tmp,
  output) at its own runtime's values and refuses more, naming the field. A task's own memory
  and CPUs (its environment) are held to the same ceiling.
- **Auth**: as the rollout servers' dev endpoints (``engines/auth.py``): the secret is read from the
  environment variable ``sandbox.api_key_env`` (never a command line), every path but ``/health``
  needs it as a Bearer token; without one the server binds only to loopback.
- **Nothing outlives it**: SIGTERM and SIGINT stop it after destroying every sandbox (commands
  killed, work directories, cgroups and containers removed); a sandbox no request touched for
  ``sandbox.idle_timeout_s`` is destroyed (its controller is gone); what a killed server left is
  removed by the next one started at the same node and port (``leftovers.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from megathunder.config import ContainerSandboxConfig, LocalSandboxConfig, RemoteSandboxConfig, is_loopback
from megathunder.rollout.engines.auth import bearer_matches, read_api_key
from megathunder.rollout.sandbox import build_sandbox, protocol
from megathunder.rollout.sandbox.core import ExecResult, Sandbox, SandboxError
from megathunder.rollout.sandbox.leftovers import Ledger, keyed_runtime
from megathunder.rollout.sandbox.server_metrics import ServerCounts, prometheus

log = logging.getLogger(__name__)
RECENT_RESULTS = 16  # per sandbox: finished commands kept by request id (a retried request's answer)
RECENT_GONE = 4096  # destroyed sandbox ids remembered, so that a late request hears why
SHUTDOWN_S = 120.0  # destroying every sandbox at stop, at most

Runtime = LocalSandboxConfig | ContainerSandboxConfig


class RequestError(Exception):
    def __init__(self, kind: protocol.ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Hosted:
    """One sandbox of this server."""

    id: str
    owner: str
    last_used: float
    sandbox: Sandbox | None = None  # None while it is being created
    state: Literal["creating", "ready", "closing"] = "creating"
    busy: int = 0  # commands, uploads and downloads in flight
    running: dict[str, asyncio.Task[ExecResult]] = field(default_factory=dict)  # by request id
    recent: OrderedDict[str, asyncio.Task[ExecResult]] = field(default_factory=OrderedDict)


def _build(runtime: Runtime, image: str | None, environment) -> Awaitable[Sandbox]:
    return build_sandbox(runtime, image, environment=environment)


class SandboxServer:
    """The registry of one server's sandboxes and its HTTP handlers (:meth:`app`)."""

    def __init__(self, cfg: RemoteSandboxConfig, key: str, api_key: str | None,
                 build: Callable[[Runtime, str | None, Any], Awaitable[Sandbox]] = _build) -> None:
        self.cfg, self.key, self.api_key, self._build = cfg, key, api_key, build
        self.runtime = keyed_runtime(cfg.runtime, key)
        self.ledger = Ledger(cfg.state_dir, key, self.runtime)
        self.server_id = uuid.uuid4().hex
        self.hosted: dict[str, Hosted] = {}
        self.gone: OrderedDict[str, str] = OrderedDict()  # destroyed id -> why
        self.counts = ServerCounts()
        self.stopping = False
        self._reaper: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle

    def sweep(self) -> list[str]:
        """What a killed server of this key left, removed (before serving)."""
        return self.ledger.sweep()

    async def start(self) -> None:
        self._reaper = asyncio.ensure_future(self._reap_idle())

    async def stop(self) -> None:
        """Refuse new work, destroy every sandbox (bounded), empty the ledger."""
        self.stopping = True
        if self._reaper is not None:
            self._reaper.cancel()
        hosted = list(self.hosted.values())
        self.hosted.clear()
        if hosted:
            done = asyncio.gather(*(self._destroy(h, "shutdown") for h in hosted), return_exceptions=True)
            try:
                await asyncio.wait_for(done, SHUTDOWN_S)
            except TimeoutError:
                log.warning("sandbox server: %d sandboxes not destroyed in %g s", len(hosted), SHUTDOWN_S)
                return  # the ledger keeps them for the next server of this key
        self.ledger.clear()

    async def _reap_idle(self) -> None:
        period = min(30.0, self.cfg.idle_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for h in list(self.hosted.values()):
                if h.state == "ready" and not h.busy and now - h.last_used > self.cfg.idle_timeout_s:
                    self.hosted.pop(h.id, None)
                    log.warning("sandbox server: %s idle for %.0f s: destroyed", h.id, now - h.last_used)
                    await self._destroy(h, "idle")

    async def _destroy(self, h: Hosted, reason: str) -> None:
        h.state = "closing"
        for task in [*h.running.values()]:
            task.cancel()
        await asyncio.gather(*h.running.values(), return_exceptions=True)
        start = time.monotonic()
        if h.sandbox is not None:
            try:
                await h.sandbox.close()
            except Exception as err:  # noqa: BLE001 -- recorded in the ledger: the next server removes it
                log.warning("sandbox server: closing %s failed: %r", h.id, err)
        self.counts.latency.add("destroy", time.monotonic() - start)
        self.counts.destroyed[reason] += 1
        self.gone[h.id] = reason
        while len(self.gone) > RECENT_GONE:
            self.gone.popitem(last=False)

    def states(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in self.hosted.values():
            state = "busy" if h.state == "ready" and h.busy else h.state
            out[state] = out.get(state, 0) + 1
        return out

    def metrics(self) -> dict[str, Any]:
        return self.counts.as_json(self.server_id, self.runtime.backend, self.cfg.max_sandboxes_per_server,
                                   self.states())

    # ------------------------------------------------------------------ requests

    def _find(self, sid: str) -> Hosted:
        h = self.hosted.get(sid)
        if h is not None and h.state == "ready":
            return h
        if sid in self.gone or (h is not None and h.state == "closing"):
            why = self.gone.get(sid, "by its client")
            reasons = {"client": "by its client", "idle": f"after {self.cfg.idle_timeout_s:g} s idle",
                       "shutdown": "at the server's shutdown"}
            raise RequestError("destroyed", f"sandbox {sid} was destroyed {reasons.get(why, why)}")
        raise RequestError("unknown_sandbox", f"unknown sandbox {sid!r} on this server (server id "
                                              f"{self.server_id[:8]}: never created here, or before a restart)")

    def _runtime_for(self, limits: dict[str, Any], environment) -> Runtime:
        """This server's runtime with a create's limits, each within the server's own."""
        own = self.runtime
        unknown = sorted(set(limits) - set(protocol.LIMIT_FIELDS))
        if unknown:
            raise RequestError("bad_request", f"limits: unknown field(s) {', '.join(unknown)}")
        asked = {k: v for k, v in limits.items() if hasattr(own, k)}
        for name in protocol.CEILED_FIELDS:
            if name in asked and asked[name] > getattr(own, name):
                raise RequestError("bad_request", f"limits.{name}: {asked[name]} is above this server's "
                                                  f"sandbox.runtime.{name}={getattr(own, name)}")
        if environment is not None:
            for name in ("memory_mb", "cpus"):
                value, ceiling = getattr(environment, name), getattr(own, name, None)
                if value is not None and ceiling is not None and value > ceiling:
                    raise RequestError("bad_request", f"task {environment.name} needs {name}={value}, above this "
                                                      f"server's sandbox.runtime.{name}={ceiling}")
        try:
            return type(own).model_validate({**own.model_dump(), **asked})
        except ValidationError as err:
            raise RequestError("bad_request", f"limits: {err.errors()[0]['loc']}: {err.errors()[0]['msg']}") from None

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.stopping:
            raise RequestError("shutting_down", "the sandbox server is shutting down")
        bound = self.cfg.max_sandboxes_per_server
        if len(self.hosted) >= bound:
            self.counts.rejected += 1
            raise RequestError("over_bound", f"the sandbox server is at its bound: {len(self.hosted)} of {bound} "
                                             "sandboxes open (sandbox.max_sandboxes_per_server)")
        try:
            image = body.get("image")
            environment = protocol.environment_from_json(body.get("environment"))
            limits = dict(body.get("limits") or {})
            owner = str(body.get("owner", ""))
        except (KeyError, TypeError, ValueError) as err:
            raise RequestError("bad_request", f"create: {type(err).__name__}: {err}") from None
        if image is not None and not isinstance(image, str):
            raise RequestError("bad_request", "create: image must be a string or null")
        runtime = self._runtime_for(limits, environment)
        h = Hosted(f"{self.server_id[:8]}-{uuid.uuid4().hex[:12]}", owner, time.monotonic())
        self.hosted[h.id] = h
        start = time.monotonic()
        try:
            sandbox = await asyncio.wait_for(self._build(runtime, image, environment), self.cfg.create_timeout_s)
        except (SandboxError, TimeoutError) as err:
            self.hosted.pop(h.id, None)
            self.counts.create_failures += 1
            why = err if isinstance(err, SandboxError) else f"not created in {self.cfg.create_timeout_s:g} s"
            raise RequestError("sandbox_error", str(why)) from None
        except BaseException:
            self.hosted.pop(h.id, None)
            raise
        self.ledger.record(sandbox)
        h.sandbox = sandbox
        if h.state == "closing" or self.hosted.get(h.id) is not h:  # destroyed (shutdown) while it was created
            await sandbox.close()
            raise RequestError("shutting_down", "the sandbox server is shutting down")
        h.state = "ready"
        self.counts.episodes += 1
        self.counts.latency.add("create", time.monotonic() - start)
        return {"id": h.id, "workdir": sandbox.workdir, "tmp_dir": sandbox.tmp_dir, "server_id": self.server_id}

    async def exec(self, sid: str, body: dict[str, Any]) -> dict[str, Any]:
        h = self._find(sid)
        h.last_used = time.monotonic()
        try:
            request_id = str(body["request_id"])
            argv = body["argv"]
            if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
                raise ValueError("argv must be a non-empty list of strings")
            stdin = protocol.bytes_from_json(body.get("stdin_b64"))
            timeout_s, max_out = body.get("timeout_s"), body.get("max_output_bytes")
            limits = protocol.limits_from_json(body.get("limits"))
        except (KeyError, TypeError, ValueError) as err:
            raise RequestError("bad_request", f"exec: {type(err).__name__}: {err}") from None
        if max_out is not None:
            max_out = min(int(max_out), self.cfg.max_request_mb << 20)
        task = h.running.get(request_id) or h.recent.get(request_id)
        if task is None:  # not a request sent again
            assert h.sandbox is not None
            task = asyncio.ensure_future(self._run(h, h.sandbox.exec(argv, stdin=stdin, timeout_s=timeout_s,
                                                                      max_output_bytes=max_out, limits=limits),
                                                   request_id))
            h.running[request_id] = task
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # this handler was cancelled, not the command
            raise RequestError("cancelled", f"command {request_id} was cancelled") from None
        except SandboxError as err:
            raise RequestError("sandbox_error", str(err)) from None
        finally:
            h.last_used = time.monotonic()
        return protocol.result_to_json(result)

    async def _run(self, h: Hosted, command: Awaitable[ExecResult], request_id: str) -> ExecResult:
        start = time.monotonic()
        h.busy += 1
        try:
            result = await command
            self.counts.commands += 1
            self.counts.latency.add("exec", time.monotonic() - start)
            return result
        finally:
            h.busy -= 1
            task = h.running.pop(request_id, None)
            if task is not None:
                h.recent[request_id] = task
                while len(h.recent) > RECENT_RESULTS:
                    h.recent.popitem(last=False)

    async def cancel(self, sid: str, body: dict[str, Any]) -> dict[str, Any]:
        h = self._find(sid)
        task = h.running.get(str(body.get("request_id")))
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its processes are killed when this returns
        return {"cancelled": task is not None}

    async def _io(self, h: Hosted, op: str, work: Awaitable[Any]) -> Any:
        start = time.monotonic()
        h.busy += 1
        h.last_used = start
        try:
            out = await work
        except SandboxError as err:
            raise RequestError("sandbox_error", str(err)) from None
        finally:
            h.busy -= 1
            h.last_used = time.monotonic()
        self.counts.latency.add(op, time.monotonic() - start)
        return out

    async def upload(self, sid: str, archive: bytes) -> dict[str, Any]:
        h = self._find(sid)
        assert h.sandbox is not None
        await self._io(h, "upload", h.sandbox.upload_tar(archive))
        return {"bytes": len(archive)}

    async def download(self, sid: str, path: str, max_bytes: int) -> bytes:
        h = self._find(sid)
        assert h.sandbox is not None
        return await self._io(h, "download", h.sandbox.download(path, min(max_bytes, self.cfg.max_request_mb << 20)))

    async def destroy(self, sid: str) -> dict[str, Any]:
        h = self.hosted.pop(sid, None)
        if h is None:
            if sid in self.gone:
                return {"destroyed": False, "already": self.gone[sid]}
            raise RequestError("unknown_sandbox", f"unknown sandbox {sid!r} on this server")
        await self._destroy(h, "client")
        return {"destroyed": True}

    # ------------------------------------------------------------------ HTTP

    def app(self):
        from aiohttp import web

        @web.middleware
        async def guarded(request: web.Request, handler):
            if request.path != "/health" and self.api_key is not None and not bearer_matches(
                    request.headers.get("Authorization"), self.api_key):
                return _reply(web, "unauthorized", "a valid Bearer token is required (sandbox.api_key_env)")
            try:
                return await handler(request)
            except RequestError as err:
                return _reply(web, err.kind, str(err))

        async def body(request: web.Request) -> dict[str, Any]:
            try:
                data = await request.json()
            except ValueError as err:
                raise RequestError("bad_request", f"the body is not JSON: {err}") from None
            if not isinstance(data, dict):
                raise RequestError("bad_request", "the body is not a JSON object")
            return data

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "stopping" if self.stopping else "ok", "server_id": self.server_id,
                                      "backend": self.runtime.backend, "max_sandboxes": self.cfg.max_sandboxes_per_server,
                                      "open": len(self.hosted)}, status=503 if self.stopping else 200)

        async def metrics(request: web.Request) -> web.Response:
            if request.query.get("format") == "json":
                return web.json_response(self.metrics())
            return web.Response(text=prometheus(self.metrics()), content_type="text/plain")

        async def create(request: web.Request) -> web.Response:
            return web.json_response(await self.create(await body(request)), status=201)

        async def exec_(request: web.Request) -> web.Response:
            return web.json_response(await self.exec(request.match_info["sid"], await body(request)))

        async def cancel(request: web.Request) -> web.Response:
            return web.json_response(await self.cancel(request.match_info["sid"], await body(request)))

        async def put_files(request: web.Request) -> web.Response:
            return web.json_response(await self.upload(request.match_info["sid"], await request.read()))

        async def get_files(request: web.Request) -> web.Response:
            path = request.query.get("path")
            if not path:
                raise RequestError("bad_request", "files: the query needs path=")
            data = await self.download(request.match_info["sid"], path, int(request.query.get("max_bytes", 64 << 20)))
            return web.Response(body=data, content_type="application/x-tar")

        async def delete(request: web.Request) -> web.Response:
            return web.json_response(await self.destroy(request.match_info["sid"]))

        app = web.Application(middlewares=[guarded], client_max_size=self.cfg.max_request_mb << 20)
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/sandboxes", create)
        app.router.add_post("/sandboxes/{sid}/exec", exec_)
        app.router.add_post("/sandboxes/{sid}/cancel", cancel)
        app.router.add_put("/sandboxes/{sid}/files", put_files)
        app.router.add_get("/sandboxes/{sid}/files", get_files)
        app.router.add_delete("/sandboxes/{sid}", delete)
        return app


def _reply(web, kind: protocol.ErrorKind, message: str):
    return web.json_response(protocol.error(kind, message), status=protocol.STATUS[kind])


# ---------------------------------------------------------------------- the command


def server_key(port: int) -> str:
    """This server's name on its node: ``<node>-<port>`` (the Slurm node's name where there is one)."""
    return f"{os.environ.get('SLURMD_NODENAME') or socket.gethostname()}-{port}"


async def serve_forever(cfg: RemoteSandboxConfig, host: str, port: int, api_key: str | None,
                        ready: Callable[[SandboxServer], None] | None = None) -> int:
    """Serve until SIGTERM or SIGINT, then destroy every sandbox and return 0."""
    from aiohttp import web

    server = SandboxServer(cfg, server_key(port), api_key)
    swept = await asyncio.to_thread(server.sweep)
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as err:
            print(f"megathunder sandbox serve: cannot listen on {host}:{port}: {err}", file=sys.stderr, flush=True)
            return 2
        await server.start()
        print(f"megathunder sandbox serve: up to {cfg.max_sandboxes_per_server} {server.runtime.backend} sandboxes at "
              f"http://{host}:{port} (server {server.key}, id {server.server_id[:8]}; removed {len(swept)} "
              f"left by an earlier server{': ' + ', '.join(swept[:5]) if swept else ''})", file=sys.stderr, flush=True)
        if ready is not None:
            ready(server)
        await stop.wait()
        print(f"megathunder sandbox serve: stopping: destroying {len(server.hosted)} sandboxes", file=sys.stderr,
              flush=True)
        await server.stop()
    finally:
        await runner.cleanup()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    m = server.metrics()
    print(f"megathunder sandbox serve: stopped; {m['episodes_total']} episodes, destroyed {m['destroyed_total']}, "
          f"{m['rejected_total']} refused at the bound", file=sys.stderr, flush=True)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config whose sandbox section is backend: remote (its runtime is served)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need "
                   "sandbox.api_key_env)")
    p.add_argument("--port", type=int, default=None, help="port (default sandbox.port)")


def run(args: argparse.Namespace) -> int:
    from megathunder.config import load_config

    cfg = load_config(args.config, args.overrides)
    sb = cfg.sandbox
    if not isinstance(sb, RemoteSandboxConfig):
        print(f"megathunder sandbox serve: sandbox.backend is {sb.backend}; a server serves the runtime of a "
              "config's `sandbox: {backend: remote, runtime: {...}}`", file=sys.stderr)
        return 2
    try:
        key = read_api_key(sb.api_key_env, "sandbox.api_key_env")
    except RuntimeError as err:
        print(f"megathunder sandbox serve: {err}", file=sys.stderr)
        return 2
    if key is None and not is_loopback(args.host):
        print(f"megathunder sandbox serve: binding to {args.host} (not loopback) needs sandbox.api_key_env: the "
              "server runs commands for whoever reaches it", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve_forever(sb, args.host, args.port or sb.port, key))


__all__ = ["Hosted", "RequestError", "SandboxServer", "add_arguments", "run", "serve_forever", "server_key"]
