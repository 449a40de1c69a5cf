"""The server deployment under faults and exposure, against stand-in servers on loopback
(tests/fake_rollout_server.py, real processes killed with SIGKILL): in-flight requests of a killed
server move to a live one; with none left, a clear error; off loopback a shared secret guards
every endpoint, and it never reaches a command line, a config dump or a log."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from megathunder.config import ConfigError, load_config
from megathunder.config import EngineConfig
from megathunder.rollout.engines import server as server_mod
from megathunder.rollout.engines.server import ServerEngine, ServerError
from megathunder.rollout.types import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t-do-not-log-7f2a"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _fake_command(port: int, delay: float) -> list[str]:
    return [sys.executable, "-m", "tests.fake_rollout_server", str(port), str(delay)]


def _wait_health(ports, timeout=20.0):
    deadline = time.monotonic() + timeout
    for port in ports:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"fake server on {port} did not start")
                time.sleep(0.05)


@pytest.fixture
def fake_servers():
    procs = []

    def start(n, delay=0.3, env=None):
        ports = _free_ports(n)
        for port in ports:
            procs.append(
                subprocess.Popen(
                    _fake_command(port, delay), cwd=ROOT, env={**os.environ, **(env or {})},
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                )
            )  # fmt: skip
        _wait_health(ports)
        return [f"http://127.0.0.1:{p}" for p in ports], procs[-n:]

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _engine(urls, headers=None) -> ServerEngine:
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), headers=headers,
        timeout=aiohttp.ClientTimeout(total=30),
    )  # fmt: skip
    return ServerEngine(urls, session, policy_version=0)


def _params(k: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=4, seed=k)


def _expected(prompt):
    return [(sum(prompt) + k) % 97 for k in range(4)]


def test_killed_server_requests_move_to_live_ones(fake_servers, caplog):
    urls, procs = fake_servers(3, delay=1.0)

    async def go():
        engine = _engine(urls)
        try:
            prompts = [[k, k + 1, 7] for k in range(90)]
            jobs = [
                asyncio.ensure_future(engine.generate(p, _params(k), session_id=k))
                for k, p in enumerate(prompts)
            ]
            await asyncio.sleep(0.15)  # every request is in flight, none answered yet
            in_flight = engine.balancer.outstanding[1]
            routed_to_victim = engine.balancer.num_routed[1]
            procs[1].send_signal(signal.SIGKILL)
            outs = await asyncio.wait_for(asyncio.gather(*jobs), 20)
            after = [await engine.generate([1, 2], _params(0), session_id=k) for k in range(6)]
            import torch

            await engine.update_weights([("w", torch.zeros(2))], 3)  # only live servers are asked
            await engine.reset_prefix_cache()
            return prompts, outs, in_flight, routed_to_victim, after, engine
        finally:
            await engine.session.close()

    with caplog.at_level(logging.WARNING, logger="megathunder.rollout.engines.server"):
        prompts, outs, in_flight, routed, after, engine = asyncio.run(go())
    assert in_flight >= 20  # about a third of the batch was on the killed server
    for p, out in zip(prompts, outs, strict=True):
        assert out.token_ids == _expected(p) and len(out.logprobs) == 4  # nothing lost
    assert engine.balancer.dead == {1} and list(engine.lost) == [1]
    assert engine.balancer.outstanding == [0, 0, 0]
    assert engine.balancer.num_routed[1] == routed  # no request went there after the kill
    assert all(a.token_ids == _expected([1, 2]) for a in after)
    assert engine.live_urls == [urls[0], urls[2]] and engine.policy_version == 3
    assert any(urls[1] in r.getMessage() and "lost" in r.getMessage() for r in caplog.records)


def test_hung_server_is_found_by_progress_and_its_requests_move(fake_servers, caplog):
    """A server that stops answering without dying (SIGSTOP: its connections stay open, so no request
    fails) is found by the hang detector -- requests in flight, none answered for stall_timeout_s, and
    /health silent -- and treated as dead: its requests are sent again to a live server, with the same
    seeds, so every completion is the one a healthy pool gives."""
    urls, procs = fake_servers(2, delay=1.0)

    async def go():
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120))
        engine = ServerEngine(urls, session, policy_version=0, stall_timeout_s=1.0)
        try:
            prompts = [[k, 3] for k in range(16)]
            jobs = [asyncio.ensure_future(engine.generate(p, _params(k), session_id=k)) for k, p in enumerate(prompts)]
            await asyncio.sleep(0.15)  # all in flight, none answered
            on_victim = len(engine._in_flight[1])
            procs[1].send_signal(signal.SIGSTOP)
            outs = await asyncio.wait_for(asyncio.gather(*jobs), 60)  # bounded: 1 s stall + 5 s /health + resend
            return prompts, outs, on_victim, engine
        finally:
            await engine.close()

    with caplog.at_level(logging.WARNING, logger="megathunder.rollout.engines.server"):
        prompts, outs, on_victim, engine = asyncio.run(go())
    assert on_victim >= 4
    for p, out in zip(prompts, outs, strict=True):
        assert out.token_ids == _expected(p)
    assert engine.balancer.dead == {1} and "hung" in engine.lost[1]
    assert engine.balancer.outstanding == [0, 0]
    assert any(urls[1] in r.getMessage() and "hung" in r.getMessage() for r in caplog.records)


def test_a_server_hung_under_a_weight_update_is_dropped_not_waited_for(fake_servers):
    """The update's pause, reset and resume are watched like requests: a server that hangs while
    idle is found when the update's pause gets no answer, and the update completes on the others."""
    import torch

    urls, procs = fake_servers(2, delay=0.0)

    async def go():
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120))
        engine = ServerEngine(urls, session, policy_version=0, stall_timeout_s=1.0)
        try:
            procs[1].send_signal(signal.SIGSTOP)
            await asyncio.wait_for(engine.update_weights([("w", torch.zeros(2))], 1), 60)
            out = await engine.generate([1, 2], _params(0))
            return engine, out
        finally:
            await engine.close()

    engine, out = asyncio.run(go())
    assert engine.balancer.dead == {1} and "hung" in engine.lost[1]
    assert engine.policy_version == 1 and out.token_ids == _expected([1, 2])


def test_a_server_killed_while_idle_is_dropped_by_the_weight_update(fake_servers):
    """A server SIGKILLed with none of its requests in flight is noticed by nothing until the
    update's pause, whose connection it refuses: it fails /health, is marked dead, and the update
    completes on the others (found by the chaos soak: the reset escaped as ClientOSError)."""
    import torch

    urls, procs = fake_servers(2, delay=0.0)

    async def go():
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120))
        engine = ServerEngine(urls, session, policy_version=0, stall_timeout_s=5.0)
        try:
            await engine.generate([1, 2], _params(0))  # keep-alive connections to both
            os.killpg(procs[1].pid, signal.SIGKILL)
            procs[1].wait()
            await asyncio.wait_for(engine.update_weights([("w", torch.zeros(2))], 1), 60)
            return engine, await engine.generate([1, 2], _params(0))
        finally:
            await engine.close()

    engine, out = asyncio.run(go())
    assert engine.balancer.dead == {1}
    assert engine.policy_version == 1 and out.token_ids == _expected([1, 2])


def test_no_live_server_left_is_a_clear_error(fake_servers):
    urls, procs = fake_servers(2, delay=5.0)

    async def go():
        engine = _engine(urls)
        try:
            jobs = [asyncio.ensure_future(engine.generate([k], _params(k))) for k in range(10)]
            await asyncio.sleep(0.15)
            for p in procs:
                p.send_signal(signal.SIGKILL)
            start = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 20)
            return results, time.monotonic() - start
        finally:
            await engine.session.close()

    results, elapsed = asyncio.run(go())
    assert elapsed < 5
    for r in results:
        assert isinstance(r, ServerError) and "no live rollout server left" in str(r)
        assert urls[0] in str(r) and urls[1] in str(r)


def test_secret_guards_the_servers_and_is_never_written(fake_servers, monkeypatch, caplog, tmp_path):
    """Servers launched through ServerPool (the fake stands in for vLLM) get the key through their
    environment; the client sends it; it is on no command line, in no log and in no config dump."""
    monkeypatch.setenv("MT_TEST_ROLLOUT_KEY", SECRET)
    monkeypatch.setattr(server_mod, "server_command", lambda model, cfg, port: _fake_command(port, 0.0))
    port = _free_ports(1)[0]
    cfg = load_config(None, [
        "rollout.engine.deployment=server", "rollout.engine.host=0.0.0.0",
        "rollout.engine.api_key_env=MT_TEST_ROLLOUT_KEY", f"rollout.engine.base_port={port}",
        "rollout.engine.startup_timeout_s=30",
    ]).rollout.engine  # fmt: skip

    async def go():
        engine = await ServerEngine.start("/m", cfg, log_dir=tmp_path)
        try:
            pid = engine.pool.servers[0].process.pid
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            out = await engine.generate([3, 4], _params(0))
            async with aiohttp.ClientSession() as anon:  # no token: refused
                async with anon.post(f"{engine.urls[0]}/collective_rpc", json={}) as r:
                    anon_status = r.status
            return out, cmdline, anon_status
        finally:
            await engine.close()

    with caplog.at_level(logging.DEBUG):
        out, cmdline, anon_status = asyncio.run(go())
    assert out.token_ids == _expected([3, 4]) and anon_status == 401
    assert SECRET not in cmdline
    assert SECRET not in caplog.text and SECRET not in repr(cfg) and SECRET not in cfg.model_dump_json()
    for log_file in tmp_path.iterdir():
        assert SECRET not in log_file.read_text(errors="replace")
    dump = subprocess.run(
        [sys.executable, "-m", "megathunder.cli", "config", str(ROOT / "configs/grpo_exactness.yaml"),
         "rollout.engine.deployment=server", "rollout.engine.host=0.0.0.0",
         "rollout.engine.api_key_env=MT_TEST_ROLLOUT_KEY"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert dump.returncode == 0 and "MT_TEST_ROLLOUT_KEY" in dump.stdout and SECRET not in dump.stdout

    monkeypatch.delenv("MT_TEST_ROLLOUT_KEY")
    with pytest.raises(ServerError, match="MT_TEST_ROLLOUT_KEY is not set"):
        asyncio.run(ServerEngine.start("/m", cfg, log_dir=tmp_path))


def test_wrong_or_missing_token_is_refused_not_retried(fake_servers, caplog):
    urls, _ = fake_servers(2, delay=0.0, env={"FAKE_API_KEY": SECRET})

    async def go(headers):
        engine = _engine(urls, headers)
        try:
            return await engine.generate([1], _params(0)), engine
        except ServerError as err:
            return err, engine
        finally:
            await engine.session.close()

    with caplog.at_level(logging.DEBUG):
        err, engine = asyncio.run(go({"Authorization": "Bearer wrong"}))
        ok, _ = asyncio.run(go({"Authorization": f"Bearer {SECRET}"}))
    assert isinstance(err, ServerError) and "401" in str(err) and not engine.balancer.dead
    assert ok.token_ids == _expected([1])
    assert SECRET not in caplog.text and SECRET not in str(err)


@pytest.mark.parametrize(
    "overrides, ok",
    [
        (["rollout.engine.host=0.0.0.0"], False),
        (["rollout.engine.host=10.1.2.3"], False),
        (["rollout.engine.host='::'"], False),
        (["rollout.engine.server_urls=[http://10.0.0.5:8000]"], False),
        (["rollout.engine.server_urls=[http://127.0.0.1:8000,http://node7:8000]"], False),
        (["rollout.engine.host=localhost"], True),
        (["rollout.engine.host=127.0.0.2"], True),
        (["rollout.engine.server_urls=[http://127.0.0.1:8000]"], True),
        (["rollout.engine.host=0.0.0.0", "rollout.engine.api_key_env=ROLLOUT_KEY"], True),
    ],
)
def test_off_loopback_needs_a_secret(overrides, ok):
    overrides = ["rollout.engine.deployment=server", *overrides]
    if ok:
        load_config(None, overrides)
    else:
        with pytest.raises(ConfigError, match=r"\n  rollout\.engine\.api_key_env: required"):
            load_config(None, overrides)


def test_api_key_env_is_a_variable_name_and_reaches_no_command_line():
    with pytest.raises(ConfigError, match="rollout.engine.api_key_env"):
        load_config(None, ["rollout.engine.api_key_env=not a name!"])
    cfg = EngineConfig(deployment="server", host="0.0.0.0", api_key_env="ROLLOUT_KEY")
    cmd = server_mod.server_command("/m", cfg, 8100)
    assert cmd[cmd.index("--middleware") + 1] == "megathunder.rollout.engines.auth.BearerAuthMiddleware"
    assert "--api-key" not in cmd  # the key goes through the environment only
    assert "--middleware" not in server_mod.server_command("/m", EngineConfig(deployment="server"), 8100)


def test_middleware_guards_vllm_dev_endpoints(monkeypatch):
    """Through vLLM's own middleware registration (the --middleware flag): the development
    endpoints vLLM leaves open under --api-key are guarded too; /health stays open."""
    import argparse

    import httpx
    from fastapi import FastAPI
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

    monkeypatch.setenv("VLLM_API_KEY", SECRET)
    app = FastAPI()
    paths = ["/pause", "/resume", "/collective_rpc", "/reset_prefix_cache",
             "/update_weight_version", "/inference/v1/generate", "/v1/models", "/metrics"]  # fmt: skip
    for path in paths:
        app.add_api_route(path, lambda: {"ok": True}, methods=["POST"])
    app.add_api_route("/health", lambda: {"ok": True}, methods=["GET"])
    args = argparse.Namespace(
        allowed_origins=["*"], allow_credentials=False, allowed_methods=["*"], allowed_headers=["*"],
        api_key=None, enable_request_id_headers=False,
        middleware=["megathunder.rollout.engines.auth.BearerAuthMiddleware"],
    )  # fmt: skip
    init_entrypoints_middleware(args, app, ())

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            anon = {p: (await c.post(p)).status_code for p in paths}
            wrong = {p: (await c.post(p, headers={"Authorization": "Bearer x"})).status_code for p in paths}
            good = {p: (await c.post(p, headers={"Authorization": f"Bearer {SECRET}"})).status_code for p in paths}
            health = (await c.get("/health")).status_code
        return anon, wrong, good, health

    anon, wrong, good, health = asyncio.run(go())
    assert set(anon.values()) == {401} and set(wrong.values()) == {401}
    assert set(good.values()) == {200} and health == 200

    monkeypatch.delenv("VLLM_API_KEY")
    from megathunder.rollout.engines.auth import BearerAuthMiddleware

    with pytest.raises(RuntimeError, match="VLLM_API_KEY is not set"):  # fails closed
        BearerAuthMiddleware(app)


def test_dropped_connection_on_a_live_server_is_retried_not_fatal(fake_servers):
    """A connection closed under a request (e.g. a keep-alive race) by a server whose /health
    still answers: the request is sent again and the server stays in the pool; a server that
    keeps dropping every request fails the request with a clear error instead of looping."""
    urls, _ = fake_servers(1, delay=0.0, env={"FAKE_DROP_FIRST": "2"})
    flaky, _ = fake_servers(1, delay=0.0, env={"FAKE_DROP_FIRST": "1000"})

    async def go(server_urls):
        engine = _engine(server_urls)
        try:
            try:
                return await asyncio.wait_for(engine.generate([5, 6], _params(0)), 20), engine
            except ServerError as err:
                return err, engine
        finally:
            await engine.session.close()

    out, engine = asyncio.run(go(urls))
    assert out.token_ids == _expected([5, 6]) and not engine.balancer.dead
    assert engine.balancer.num_routed == [3]
    err, engine = asyncio.run(go(flaky))
    assert isinstance(err, ServerError) and "connection dropped 3 times" in str(err)
    assert not engine.balancer.dead


def test_failover_under_load_leaks_nothing(fake_servers):
    """600 concurrent requests over 3 servers, one killed under them, then the engine closed:
    every request answered, and the client's file descriptors come back to their baseline."""
    import psutil

    urls, procs = fake_servers(3, delay=0.3)
    me = psutil.Process()

    async def go():
        engine = _engine(urls)
        try:
            jobs = [
                asyncio.ensure_future(engine.generate([k % 50, 3], _params(k), session_id=k % 40))
                for k in range(600)
            ]
            await asyncio.sleep(0.1)
            procs[2].send_signal(signal.SIGKILL)
            outs = await asyncio.wait_for(asyncio.gather(*jobs), 60)
            return outs, engine
        finally:
            await engine.session.close()
            await asyncio.sleep(0.1)

    fds_before = me.num_fds()
    outs, engine = asyncio.run(go())
    procs[2].wait()
    assert [o.token_ids for o in outs] == [_expected([k % 50, 3]) for k in range(600)]
    assert engine.balancer.dead == {2} and engine.balancer.outstanding == [0, 0, 0]
    assert me.num_fds() == fds_before
