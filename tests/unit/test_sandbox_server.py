"""Sandbox servers (``megathunder sandbox serve``) and the ``remote`` backend, on loopback with the
local runtime: sandboxes spread over two servers (their metrics count them), a server killed or
hung mid-run (its sandboxes re-run on the other, nothing leaked), and bad input (a wrong token, an
unknown sandbox, a command after destroy, a server over its bound: clear errors, nothing leaked)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from megathunder.config import RemoteSandboxConfig  # noqa: E402
from megathunder.rollout.sandbox import SandboxError, build_sandbox, close_sandbox_pools  # noqa: E402
from megathunder.rollout.sandbox.core import ExecResult, Sandbox  # noqa: E402
from megathunder.rollout.sandbox.remote import RemoteSandbox  # noqa: E402
from megathunder.rollout.sandbox.sandbox_server import SandboxServer  # noqa: E402
from megathunder.rollout.sandbox.server_pool import pools  # noqa: E402
from tests.rollout_helpers import needs_root  # noqa: E402

KEY_ENV = "MT_TEST_SANDBOX_KEY"
SECRET = "s3cret-token"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def root(monkeypatch):
    """A work-dir root of this test's own (traversable by the sandbox uids), checked empty at the end."""
    monkeypatch.setenv(KEY_ENV, SECRET)
    path = Path(f"/tmp/megathunder-test-sbx-{uuid.uuid4().hex[:8]}")
    yield path
    leftovers = [p for p in path.rglob("*")] if path.exists() else []
    shutil.rmtree(path, ignore_errors=True)
    assert not [p for p in leftovers if p.is_dir() and p.parent.parent == path], f"work dirs leaked: {leftovers}"


def server_cfg(root: Path, state: Path, **kw) -> RemoteSandboxConfig:
    runtime = {"backend": "local", "root_dir": str(root), "wall_time_s": 10, "cpu_time_s": 5, "memory_mb": 256,
               "max_processes": 32, "num_uids": 64}
    return RemoteSandboxConfig.model_validate({"backend": "remote", "runtime": runtime, "api_key_env": KEY_ENV,
                                               "state_dir": str(state),
                                               "max_sandboxes_per_server": 8, "hang_grace_s": 2.0, **kw})


def client_cfg(cfg: RemoteSandboxConfig, urls: list[str], **kw) -> RemoteSandboxConfig:
    return cfg.model_copy(update={"server_urls": urls, **kw})


class Running:
    """One in-process server on a loopback port."""

    def __init__(self, server: SandboxServer, runner: web.AppRunner, url: str) -> None:
        self.server, self.runner, self.url = server, runner, url

    async def stop(self) -> None:
        await self.server.stop()
        await self.runner.cleanup()


async def start(cfg: RemoteSandboxConfig, name: str, api_key: str | None = SECRET, build=None) -> Running:
    kw = {} if build is None else {"build": build}
    server = SandboxServer(cfg, f"test-{name}", api_key, **kw)
    server.sweep()
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    await server.start()
    return Running(server, runner, f"http://127.0.0.1:{port}")


async def episode(cfg: RemoteSandboxConfig, k: int, hold_s: float = 0.0) -> tuple[str, ExecResult, bytes]:
    """One episode's sandbox use: upload, a command that reads it, a download, then destroy."""
    sb = await build_sandbox(cfg)
    assert isinstance(sb, RemoteSandbox)
    try:
        await sb.upload({"in.txt": f"episode {k}\n"})
        if hold_s:
            await asyncio.sleep(hold_s)  # the model generating: the sandbox open and idle
        result = await sb.exec(["sh", "-c", "cat in.txt > out.txt; cat out.txt"])
        archive = await sb.download("out.txt")
        return sb.placements[-1], result, archive
    finally:
        await sb.close()


@needs_root  # the local runtime (bwrap, a uid per sandbox) runs as root here
def test_many_sandboxes_spread_over_two_servers_and_are_counted(root, tmp_path):
    async def go():
        cfg = server_cfg(root, tmp_path)
        a, b = await start(cfg, "a"), await start(cfg, "b")
        try:
            client = client_cfg(cfg, [a.url, b.url])
            out = await asyncio.wait_for(asyncio.gather(*(episode(client, k, 0.2) for k in range(24))), 60)
            stats = pools()[0].stats()
            return out, a.server.metrics(), b.server.metrics(), stats
        finally:
            await close_sandbox_pools()
            await a.stop()
            await b.stop()

    out, ma, mb, stats = asyncio.run(go())
    for k, (_, result, archive) in enumerate(out):
        assert result.ok and result.output == f"episode {k}\n" and f"episode {k}".encode() in archive
    placed = [url for url, _, _ in out]
    assert len(set(placed)) == 2
    # least loaded placement: 24 episodes held open together over two servers of 8 each
    assert ma["episodes_total"] + mb["episodes_total"] == 24 and min(ma["episodes_total"], mb["episodes_total"]) >= 8
    for m in (ma, mb):
        assert m["destroyed_total"] == {"client": m["episodes_total"]} and sum(m["open"].values()) == 0
        assert m["commands_total"] == m["episodes_total"] == m["latency_s"]["create"]["count"] == m["latency_s"]["upload"]["count"]
        assert m["rejected_total"] == 0
    assert all(s["open"] == 0 and s["lost"] is None for s in stats["servers"].values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(config: Path, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "megathunder.cli", "sandbox", "serve", str(config), "--port", str(port)],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


async def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                async with s.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"{url} not healthy in {within_s} s: {log.read_text()}")


def _processes_under(root: Path) -> list[int]:
    """Processes whose command line names ``root`` (the sandboxes' bwrap and their commands)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if str(root).encode() in cmdline and b"sandbox\x00serve" not in cmdline:
                found.append(int(pid))
    return found


@needs_root  # the local runtime (bwrap, a uid per sandbox) runs as root here
def test_killed_server_sandboxes_rerun_on_the_other_and_nothing_leaks(root, tmp_path):
    cfg = server_cfg(root, tmp_path / "state")
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"sandbox": cfg.model_dump(mode="json")}))
    ports = [_free_port(), _free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [_serve(config, p, tmp_path / f"server{i}.log") for i, p in enumerate(ports)]
    try:
        async def go():
            await asyncio.gather(*(_wait_healthy(u, p, tmp_path / f"server{i}.log")
                                   for i, (u, p) in enumerate(zip(urls, procs))))
            client = client_cfg(cfg, urls)
            sandboxes = [await build_sandbox(client) for _ in range(8)]
            try:
                for k, sb in enumerate(sandboxes):
                    r = await sb.exec(["sh", "-c", f"echo {k} > state.txt; echo made {k}"])
                    assert r.ok
                before = [sb.placements[-1] for sb in sandboxes]
                os.killpg(procs[0].pid, signal.SIGKILL)  # server 0 dies mid-episode
                procs[0].wait(10)
                after = await asyncio.wait_for(asyncio.gather(*(sb.exec(["cat", "state.txt"]) for sb in sandboxes)), 60)
                moved = [sb.placements for sb in sandboxes if len(sb.placements) == 2]
                stats = pools()[0].stats()
            finally:
                for sb in sandboxes:
                    await sb.close()
                await close_sandbox_pools()
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {SECRET}"}) as s:
                async with s.get(f"{urls[1]}/metrics?format=json") as r:
                    metrics = await r.json()
            return before, after, moved, stats, metrics

        before, after, moved, stats, metrics = asyncio.run(go())
        assert before.count(urls[0]) == 4 and before.count(urls[1]) == 4  # least loaded: spread evenly
        assert [r.output for r in after] == [f"{k}\n" for k in range(8)]  # the state, rebuilt by replay
        assert len(moved) == 4 and all(p == [urls[0], urls[1]] for p in moved)
        assert stats["failovers"] == 4 and stats["servers"][urls[0]]["lost"] is not None
        assert metrics["episodes_total"] == 8 and metrics["destroyed_total"] == {"client": 8}
        assert not _processes_under(root)  # the killed server's sandboxes died with it (bwrap --die-with-parent)
        # what the killed one left on disk is removed by the next server started at its node and port
        assert any((root / f"{socket.gethostname()}-{ports[0]}").iterdir())
        procs[0] = _serve(config, ports[0], tmp_path / "server0-again.log")
        asyncio.run(_wait_healthy(urls[0], procs[0], tmp_path / "server0-again.log"))
        left = list((root / f"{socket.gethostname()}-{ports[0]}").iterdir())
        assert not left, (left, (tmp_path / "server0-again.log").read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for i, p in enumerate(procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                raise
    assert all(p.returncode == 0 for p in procs[1:])
    assert not _processes_under(root)
    left = [p for d in root.iterdir() for p in d.iterdir()]
    assert not left, left  # every work dir removed (SIGTERM: all destroyed)


class _Hangs(Sandbox):
    """A sandbox whose commands never answer once ``hung`` is set (a server stuck, /health fine)."""

    def __init__(self, inner: Sandbox, hung: asyncio.Event) -> None:
        self.inner, self.hung = inner, hung
        self.workdir, self.tmp_dir = inner.workdir, inner.tmp_dir

    async def exec(self, argv, **kw) -> ExecResult:
        if self.hung.is_set():
            await asyncio.Event().wait()
        return await self.inner.exec(argv, **kw)

    async def close(self) -> None:
        await self.inner.close()


@needs_root  # the local runtime (bwrap, a uid per sandbox) runs as root here
def test_hung_server_is_found_by_progress_and_its_sandbox_rerun(root, tmp_path):
    async def go():
        cfg = server_cfg(root, tmp_path, hang_grace_s=0.5)
        hung = asyncio.Event()

        async def hanging(runtime, image, environment):
            return _Hangs(await build_sandbox(runtime, image, environment=environment), hung)

        a = await start(cfg, "a", build=hanging)
        b = await start(cfg, "b")
        client = client_cfg(cfg, [a.url, b.url], runtime=cfg.runtime.model_copy(update={"wall_time_s": 1}))
        sb = await build_sandbox(client)
        try:
            assert sb.placements == [a.url]  # lowest index on a tie
            await sb.exec(["sh", "-c", "echo kept > f"])
            hung.set()
            t0 = time.monotonic()
            got = await asyncio.wait_for(sb.exec(["cat", "f"]), 60)
            waited = time.monotonic() - t0
            healthy = await pools()[0].healthy(pools()[0].servers[0])
            return got, waited, sb.placements, healthy, pools()[0].servers[0].lost
        finally:
            await sb.close()
            await close_sandbox_pools()
            await a.stop()
            await b.stop()

    got, waited, placements, healthy, lost = asyncio.run(go())
    assert got.output == "kept\n" and len(placements) == 2
    assert healthy and lost is not None and "hung" in lost  # /health answered; progress said hung
    assert 1.5 <= waited < 30  # the command's 1 s wall limit + 0.5 s grace, then the re-run (a loaded machine: slack)


@needs_root  # the local runtime (bwrap, a uid per sandbox) runs as root here
def test_lost_server_without_failover_fails_the_sandbox_never_an_observation(root, tmp_path):
    async def go():
        cfg = server_cfg(root, tmp_path, max_failovers=0)
        a, b = await start(cfg, "a"), await start(cfg, "b")
        sb = await build_sandbox(client_cfg(cfg, [a.url, b.url]))
        try:
            await sb.exec(["true"])
            await a.runner.cleanup()  # the server gone: connections refused, /health silent
            with pytest.raises(SandboxError, match="re-run 0 times"):
                await sb.exec(["true"])
            with pytest.raises(SandboxError, match="re-run 0 times"):  # and stays broken
                await sb.exec(["true"])
        finally:
            await sb.close()
            await close_sandbox_pools()
            await a.server.stop()
            await b.stop()

    asyncio.run(go())


async def _raw(method: str, url: str, token: str | None = SECRET, **kw) -> tuple[int, dict]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(headers=headers) as s:
        async with s.request(method, url, timeout=aiohttp.ClientTimeout(total=30), **kw) as r:
            return r.status, await r.json(content_type=None)


@needs_root  # the local runtime (bwrap, a uid per sandbox) runs as root here
def test_bad_input_gets_clear_errors_and_leaks_nothing(root, tmp_path):
    servers: list[SandboxServer] = []

    async def go():
        cfg = server_cfg(root, tmp_path, max_sandboxes_per_server=2)
        a = await start(cfg, "a")
        servers.append(a.server)
        u = a.url
        try:
            answers = {"health": await _raw("GET", f"{u}/health", token=None),
                       "no_token": await _raw("POST", f"{u}/sandboxes", token=None, json={}),
                       "wrong_token": await _raw("POST", f"{u}/sandboxes", token="guess", json={}),
                       "wrong_metrics": await _raw("GET", f"{u}/metrics?format=json", token="guess"),
                       "unknown": await _raw("POST", f"{u}/sandboxes/nope/exec", json={"request_id": "1", "argv": ["id"]}),
                       "not_json": await _raw("POST", f"{u}/sandboxes", data=b"{"),
                       "too_much": await _raw("POST", f"{u}/sandboxes", json={"limits": {"memory_mb": 1 << 20}})}
            made = [await _raw("POST", f"{u}/sandboxes", json={}) for _ in range(2)]
            answers["over_bound"] = await _raw("POST", f"{u}/sandboxes", json={})
            sid = made[0][1]["id"]
            answers["bad_argv"] = await _raw("POST", f"{u}/sandboxes/{sid}/exec", json={"request_id": "1", "argv": "id"})
            answers["destroy"] = await _raw("DELETE", f"{u}/sandboxes/{sid}")
            answers["after_destroy"] = await _raw("POST", f"{u}/sandboxes/{sid}/exec",
                                                  json={"request_id": "2", "argv": ["id"]})
            answers["destroy_again"] = await _raw("DELETE", f"{u}/sandboxes/{sid}")
            # a controller with the wrong secret is refused before any episode
            os.environ[KEY_ENV] = "guess"
            with pytest.raises(SandboxError, match="refused this controller's token"):
                await build_sandbox(client_cfg(cfg, [u]))
            os.environ[KEY_ENV] = SECRET
            return answers, a.server.metrics()["open"]
        finally:
            await close_sandbox_pools()
            await a.stop()

    answers, open_before_stop = asyncio.run(go())
    metrics = servers[0].metrics()
    assert answers["health"][0] == 200 and answers["health"][1]["max_sandboxes"] == 2
    for name in ("no_token", "wrong_token", "wrong_metrics"):
        assert answers[name] == (401, {"kind": "unauthorized", "error": answers[name][1]["error"]})
        assert "Bearer token" in answers[name][1]["error"]
    assert answers["unknown"][0] == 404 and "unknown sandbox 'nope'" in answers["unknown"][1]["error"]
    assert answers["not_json"][0] == 400 and "not JSON" in answers["not_json"][1]["error"]
    assert answers["too_much"][0] == 400 and "limits.memory_mb" in answers["too_much"][1]["error"]
    assert answers["over_bound"][0] == 429 and "at its bound: 2 of 2" in answers["over_bound"][1]["error"]
    assert answers["bad_argv"][0] == 400 and "argv" in answers["bad_argv"][1]["error"]
    assert answers["destroy"] == (200, {"destroyed": True})
    assert answers["after_destroy"][0] == 410 and "destroyed by its client" in answers["after_destroy"][1]["error"]
    assert answers["destroy_again"] == (200, {"destroyed": False, "already": "client"})
    assert open_before_stop["ready"] == 1  # the refused ones were never created
    assert metrics["rejected_total"] == 1 and metrics["episodes_total"] == 2
    assert metrics["destroyed_total"] == {"client": 1, "shutdown": 1}


@needs_root  # the local runtime (bwrap, a uid per sandbox) runs as root here
def test_swe_episodes_over_two_servers_one_lost_mid_run_score_as_without_the_fault(root, tmp_path):
    """The shipped SWE-style set through the agent loop on two servers: the episodes spread over
    both; one server gone mid-run (after the first tool calls): its episodes' sandboxes are re-run
    on the other and every episode scores as in the fault-free run -- no failure, no zero reward."""
    from megathunder.config import AgentLoopConfig, VerifierConfig
    from megathunder.rollout.agent_loop import AgentLoop
    from megathunder.rollout.scripted import ScriptedPolicy
    from megathunder.rollout.tasks.swe_local import SweLocalTask
    from megathunder.rollout.verifiers import VerifierPool
    from tests.rollout_helpers import codec

    task = SweLocalTask()
    instances = task.instances(6, seed=2)

    def run(kill_after_turns: int | None):
        async def go():
            cfg = server_cfg(root, tmp_path / str(kill_after_turns), max_sandboxes_per_server=12)
            a, b = await start(cfg, "a"), await start(cfg, "b")
            c = codec()
            killed: list[asyncio.Task] = []
            turns = 0

            def emit(event):
                nonlocal turns
                turns += event.kind == "turn_finished"
                if kill_after_turns is not None and turns == kill_after_turns and not killed:
                    killed.append(asyncio.ensure_future(a.runner.cleanup()))  # connections refused from now on

            loop = AgentLoop(ScriptedPolicy(c, {i.prompt: task.scripted_turns(i) for i in instances}), c, task,
                             AgentLoopConfig(max_total_tokens=8192, max_new_tokens_per_turn=1024,
                                             max_concurrent_episodes=12),
                             client_cfg(cfg, [a.url, b.url]), VerifierPool(VerifierConfig(timeout_s=60)), emit=emit)
            try:
                episodes = await asyncio.wait_for(loop.run_batch(instances, 2), 240)
                stats = pools()[0].stats()
            finally:
                await close_sandbox_pools()
                await asyncio.gather(*killed)
                await a.server.stop()
                if not killed:
                    await a.runner.cleanup()
                await b.stop()
            return episodes, stats, a.server.metrics(), b.server.metrics()

        return asyncio.run(go())

    clean, clean_stats, ca, cb = run(None)
    faulted, stats, fa, fb = run(4)
    assert ca["episodes_total"] > 0 and cb["episodes_total"] > 0  # spread over both
    assert clean_stats["failovers"] == 0 and stats["failovers"] > 0
    assert fb["episodes_total"] > cb["episodes_total"] - 1 and fa["destroyed_total"].get("shutdown", 0) > 0
    key = lambda ep: (ep.group_id, ep.traj_id)  # noqa: E731
    assert [ep.failure for ep in faulted] == [None] * 12, [ep.failure for ep in faulted]
    assert [ep.reward.reward for ep in sorted(faulted, key=key)] == [ep.reward.reward for ep in sorted(clean, key=key)]
    assert all(ep.reward.reward == 1.0 for ep in clean)


@pytest.mark.parametrize(("overrides", "error"), [
    (["sandbox.server_urls=[\"http://10.0.0.5:8300\"]"],
     "sandbox.api_key_env: required for sandbox servers off loopback (http://10.0.0.5:8300)"),
    ([], "api_key_env: required for sandbox servers off loopback (servers found from the Slurm job)"),
    (["sandbox.api_key_env=K", "sandbox.server_urls=[\"ftp://a:1\"]"], "'ftp://a:1' is not http://host:port"),
    (["sandbox.api_key_env=K", "sandbox.server_urls=[\"http://a:1\",\"http://a:1\"]"], "a server is listed twice"),
    (["sandbox.api_key_env=K", "sandbox.max_sandboxes_per_server=300"],
     "runtime.num_uids: 256 is fewer than max_sandboxes_per_server=300"),
    (["sandbox.api_key_env=K", "task.name=swe_bench", "task.path=x.jsonl"],
     "sandbox.runtime.backend: task swe_bench runs in each instance's container image"),
])
def test_remote_config_is_checked_when_parsed(overrides, error):
    from megathunder.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, ["sandbox.backend=remote", *overrides])
    assert error in str(err.value), str(err.value)


def test_verifier_concurrency_follows_the_servers_capacity():
    from megathunder.config import load_config

    urls = 'sandbox.server_urls=["http://127.0.0.1:1","http://127.0.0.1:2"]'
    cfg = load_config(None, ["sandbox.backend=remote", urls, "sandbox.max_sandboxes_per_server=8",
                             "agent.max_concurrent_episodes=64"])
    assert cfg.verifier.max_concurrent == 16  # the servers hold 16 sandboxes: 16 test runs at once
    assert load_config(None, []).verifier.max_concurrent == 4  # the controller's own: as before
    assert load_config(None, ["sandbox.backend=remote", urls, "verifier.max_concurrent=3"]).verifier.max_concurrent == 3


def test_servers_are_found_from_the_slurm_jobs_sandbox_steps(tmp_path, monkeypatch):
    """``sandbox.server_urls`` empty: the nodes of the job's steps named ``sandbox`` (as the launch
    scripts name them), each at its NodeAddr and ``sandbox.port``; outside a job, a clear error."""
    from megathunder.rollout.sandbox.discovery import server_urls

    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\n"
                        "if [ \"$2\" = step ]; then\n"
                        "  echo 'StepId=7.0 UserId=0 Name=rollout NodeList=gpu[01-02] State=RUNNING'\n"
                        "  echo 'StepId=7.1 UserId=0 Name=sandbox NodeList=gpu[01-02] State=RUNNING'\n"
                        "  echo 'StepId=7.2 UserId=0 Name=sandbox NodeList=cpu07 State=RUNNING'\n"
                        "else echo \"NodeName=$4 NodeAddr=10.0.0.$(echo $4 | tr -dc 0-9 | sed 's/^0*//') State=ALLOC\"; fi\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    cfg = RemoteSandboxConfig(backend="remote", api_key_env="K", port=8311)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(SandboxError, match="not a Slurm job"):
        server_urls(cfg)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert server_urls(cfg) == ["http://10.0.0.1:8311", "http://10.0.0.2:8311", "http://10.0.0.7:8311"]
    assert server_urls(cfg.model_copy(update={"server_urls": ["http://h:1"]})) == ["http://h:1"]


@needs_root
def test_episode_on_a_lost_server_that_cannot_be_rerun_is_an_infrastructure_failure(root, tmp_path):
    """``max_failovers: 0``: the episodes whose server is lost mid-run fail with
    ``verifier.on_infra_failure`` (here drop_group: no reward at all), never a zero that trains; the
    episodes on the other server are untouched."""
    from megathunder.config import AgentLoopConfig, VerifierConfig
    from megathunder.rollout.agent_loop import AgentLoop
    from megathunder.rollout.scripted import ScriptedPolicy
    from megathunder.rollout.tasks.swe_local import SweLocalTask
    from megathunder.rollout.verifiers import VerifierPool
    from tests.rollout_helpers import codec

    task = SweLocalTask()
    instances = task.instances(2, seed=4)

    async def go():
        cfg = server_cfg(root, tmp_path, max_failovers=0)
        a, b = await start(cfg, "a"), await start(cfg, "b")
        c = codec()
        killed: list[asyncio.Task] = []

        def emit(event):
            if event.kind == "turn_finished" and not killed:
                killed.append(asyncio.ensure_future(a.runner.cleanup()))

        loop = AgentLoop(ScriptedPolicy(c, {i.prompt: task.scripted_turns(i) for i in instances}), c, task,
                         AgentLoopConfig(max_total_tokens=8192, max_new_tokens_per_turn=1024, max_concurrent_episodes=4),
                         client_cfg(cfg, [a.url, b.url]),
                         VerifierPool(VerifierConfig(timeout_s=60, on_infra_failure="drop_group")), emit=emit)
        try:
            return await asyncio.wait_for(loop.run_batch(instances, 2), 120)
        finally:
            await close_sandbox_pools()
            await asyncio.gather(*killed)
            await a.server.stop()
            await b.stop()

    episodes = asyncio.run(go())
    failed = [ep for ep in episodes if ep.failure]
    assert 0 < len(failed) < len(episodes)  # the lost server's episodes, not the other's
    for ep in failed:
        assert ep.failure.startswith("sandbox_error: ") and "re-run 0 times" in ep.failure, ep.failure
        assert ep.reward.infra and ep.reward.drop_group and ep.reward.reward is None
    assert all(ep.reward.reward == 1.0 for ep in episodes if not ep.failure)


@needs_root
def test_per_sandbox_limits_hold_on_the_server_and_idle_sandboxes_are_reaped(root, tmp_path):
    """A command past its sandbox's wall-time limit is killed on the server (a result, not a hang);
    a sandbox no request touched for ``idle_timeout_s`` is destroyed (its controller is gone), and a
    late request hears why."""
    async def go():
        cfg = server_cfg(root, tmp_path, idle_timeout_s=0.4)
        a = await start(cfg, "a")
        try:
            sb = await build_sandbox(client_cfg(cfg, [a.url], runtime=cfg.runtime.model_copy(update={"wall_time_s": 1})))
            t0 = time.monotonic()
            slow = await sb.exec(["sleep", "30"])
            slow_s = time.monotonic() - t0
            await sb.close()
            status, made = await _raw("POST", f"{a.url}/sandboxes", json={})
            assert status == 201, made
            for _ in range(100):  # the reaper looks every 0.1 s
                await asyncio.sleep(0.1)
                if not a.server.hosted:
                    break
            late = await _raw("POST", f"{a.url}/sandboxes/{made['id']}/exec", json={"request_id": "1", "argv": ["id"]})
            return slow, slow_s, late, a.server.metrics()
        finally:
            await close_sandbox_pools()
            await a.stop()

    slow, slow_s, late, metrics = asyncio.run(go())
    assert slow.timed_out and "wall-time limit of 1 s exceeded" in slow.observation() and slow_s < 15
    assert late[0] == 410 and "destroyed after 0.4 s idle" in late[1]["error"]
    assert metrics["destroyed_total"] == {"client": 1, "idle": 1}
