"""Soak: hundreds of concurrent episodes, batch after batch for a bounded time, with faults mixed
in, then a check that nothing leaked.

Each batch runs ``NUM_PROMPTS x SAMPLES`` (256) episodes at once through the scripted engine:
tool calls to a fake-latency HTTP tool server on loopback and to an in-process sleeping tool, one
malformed call per episode, and deterministic faults (non-finite engine logprobs, crashing tools,
crashing, hanging and subprocess verifiers). Beside them, a second agent loop runs episodes with
real bash tool calls in the local sandbox (as root). After a warm-up batch, the process's open
file descriptors, child processes, threads and asyncio tasks must come back to exactly their
baseline, no sandbox directory, cgroup or sandbox-uid process may remain, and resident memory
may grow by at most ``RSS_BOUND_MIB``. Figures are printed (``-s``) and recorded in RELIABILITY.md.

``MEGATHUNDER_SOAK_S`` (default 12; at least two measured batches) bounds the measured phase.
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
import time

import psutil
import pytest

from megathunder.config import AgentLoopConfig, LocalSandboxConfig, VerifierConfig
from megathunder.rollout.agent_loop import AgentLoop
from megathunder.rollout.scripted import ScriptedPolicy
from megathunder.rollout.tools import BASH, Tool
from megathunder.rollout.types import Completion
from megathunder.rollout.verifiers import VerifierPool, in_subprocess
from megathunder.rollout.tasks.task import Task, TaskInstance, tool_call_text
from tests.rollout_helpers import codec, sandbox_cfg
from tests.verifier_fns import blocking_reward

SOAK_S = float(os.environ.get("MEGATHUNDER_SOAK_S", "12"))
NUM_PROMPTS, SAMPLES = 64, 4  # 256 concurrent episodes per batch
RSS_BOUND_MIB = 32
SANDBOX_EPISODES = 8  # per batch, beside the others, with real bash calls


def _kind(k: int) -> str:
    """The fault (or none) of prompt k, the same in every batch."""
    for mod, kind in ((17, "nan_logprob"), (13, "verifier_raises"), (29, "verifier_hangs"),
                      (11, "tool_crashes"), (31, "verifier_subprocess")):  # fmt: skip
        if k % mod == 0 and k:
            return kind
    return "clean"


class _SoakTask(Task):
    name = "soak"

    def __init__(self, tools) -> None:
        self.tools = tuple(tools)

    def instances(self, num, seed=0):
        return [TaskInstance(f"soak-{k}", f"soak {k}", answer=k) for k in range(num)]

    async def verify(self, inst, episode, sandbox):
        if sandbox is not None:  # the sandbox episodes: their bash call left a file
            return float((await sandbox.shell("test -f out.txt")).ok)
        kind = _kind(inst.answer)
        if kind == "verifier_raises":
            raise RuntimeError("grader bug")
        if kind == "verifier_hangs":
            await asyncio.sleep(3600)
        if kind == "verifier_subprocess":
            return await in_subprocess(blocking_reward, 0.5)
        return float(f"answer {inst.answer}" in episode.final_text)


def _script(k: int) -> list[str]:
    key = "crash" if _kind(k) == "tool_crashes" else f"k{k}"
    return [
        tool_call_text("lookup", key=key),
        "<tool_call>{broken</tool_call>",
        tool_call_text("wait", ms=str(1 + k % 9)),
        f"answer {k}",
    ]


class _FaultyPolicy(ScriptedPolicy):
    async def generate(self, prompt_token_ids, params, *, session_id=None) -> Completion:
        out = await super().generate(prompt_token_ids, params, session_id=session_id)
        text = self.codec.decode(prompt_token_ids)
        k = int(text.split("soak ", 2)[1].split("<", 1)[0])
        if _kind(k) == "nan_logprob" and text.count("<|im_start|>assistant\n") == 2:
            return Completion(out.token_ids, [math.nan] * len(out.token_ids), "stop", 0)
        return out


async def _tool_server():
    """A fake-latency tool service on loopback (an aiohttp server in this event loop)."""
    from aiohttp import web

    async def lookup(request):
        key = request.query["key"]
        await asyncio.sleep(0.001 + (hash(key) % 10) / 1000)
        return web.json_response({"value": key.upper()})

    app = web.Application()
    app.router.add_get("/lookup", lookup)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def _tools(session, url):
    async def lookup(sb, args):
        if args["key"] == "crash":
            raise ConnectionError("tool backend went away")
        async with session.get(f"{url}/lookup", params={"key": args["key"]}) as r:
            return (await r.json())["value"]

    async def wait(sb, args):
        await asyncio.sleep(int(args["ms"]) / 1000)
        return "waited"

    return [
        Tool("lookup", "Look a key up.", {"key": "the key"}, lookup, needs_sandbox=False),
        Tool("wait", "Wait.", {"ms": "milliseconds"}, wait, needs_sandbox=False),
    ]


def _snapshot(proc: psutil.Process) -> dict:
    gc.collect()
    return {
        "fds": proc.num_fds(),
        "children": sorted(c.pid for c in proc.children(recursive=True)),
        "threads": proc.num_threads(),
        "rss_mib": proc.memory_info().rss / 2**20,
    }


def _sandbox_leftovers(cfg: LocalSandboxConfig) -> list[str]:
    left = [f"dir {e}" for e in os.listdir(cfg.root_dir)] if os.path.isdir(cfg.root_dir) else []
    for p in psutil.process_iter(["uids"]):
        try:
            if cfg.uid_base <= p.info["uids"].real < cfg.uid_base + cfg.num_uids and p.status() != "zombie":
                left.append(f"process {p.pid} of uid {p.info['uids'].real}")
        except (psutil.NoSuchProcess, TypeError):
            pass
    for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids"):
        for dirpath, dirnames, _ in os.walk(base):
            left += [f"cgroup {dirpath}/{d}" for d in dirnames if d.startswith(f"megathunder-sbx-{os.getpid()}-")]
    return left


async def _soak(with_sandbox: bool, tmp_path):
    import aiohttp

    c = codec()
    runner, url = await _tool_server()
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
    task = _SoakTask(_tools(session, url))
    insts = task.instances(NUM_PROMPTS)
    policy = _FaultyPolicy(c, {i.prompt: _script(k) for k, i in enumerate(insts)}, seconds_per_token=1e-5)
    agent = AgentLoopConfig(max_turns=6, max_total_tokens=4096, max_new_tokens_per_turn=256,
                            max_concurrent_episodes=NUM_PROMPTS * SAMPLES)  # fmt: skip
    loop = AgentLoop(
        policy, c, task, agent, LocalSandboxConfig(),
        VerifierPool(VerifierConfig(timeout_s=3, max_concurrent=64, on_failure="drop_group")),
    )  # fmt: skip

    sb_loop = sb_cfg = None
    if with_sandbox:
        sb_task = _SoakTask([BASH])
        sb_insts = [TaskInstance(f"sb-{k}", f"soak {k}", answer=100 + k) for k in range(SANDBOX_EPISODES)]
        sb_script = [tool_call_text("bash", command="echo hi > out.txt; ls"), "answer done"]
        sb_cfg = sandbox_cfg(tmp_path, root_dir=f"/tmp/megathunder-soak-{os.getpid()}")
        sb_loop = AgentLoop(
            ScriptedPolicy(c, {i.prompt: sb_script for i in sb_insts}), c, sb_task,
            AgentLoopConfig(max_turns=4, max_concurrent_episodes=4), sb_cfg,
            VerifierPool(VerifierConfig(timeout_s=10)),
        )  # fmt: skip

    stats = {"batches": 0, "episodes": 0, "sandbox_episodes": 0, "failed": 0, "tool_errors": 0}

    async def batch(seed: int) -> None:
        jobs = [loop.run_batch(insts, SAMPLES, seed=seed)]
        if sb_loop is not None:
            jobs.append(sb_loop.run_batch(sb_insts, 1, seed=seed))
        results = await asyncio.gather(*jobs)
        episodes = results[0]
        for ep in episodes:  # every fault has its defined outcome, under load too
            kind = _kind(insts[ep.group_id].answer)
            expect = {"nan_logprob": "nonfinite_logprob", "verifier_raises": "verifier_error",
                      "verifier_hangs": "verifier_timeout"}.get(kind)  # fmt: skip
            if expect is None:
                assert ep.failure is None, (kind, ep.failure)
                assert ep.reward.reward == 1.0 and ep.stop_reason == "answered", (kind, ep.reward)
            else:
                assert ep.failure is not None and ep.failure.startswith(expect), (kind, ep.failure)
                assert ep.reward.drop_group
            if kind == "tool_crashes":
                assert "tool backend went away" in ep.turns[0].tool_runs[0].observation
        stats["tool_errors"] += sum(not r.ok for ep in episodes for t in ep.turns for r in t.tool_runs)
        stats["failed"] += sum(ep.failure is not None for ep in episodes)
        stats["episodes"] += len(episodes)
        if sb_loop is not None:
            assert all(ep.reward.reward == 1.0 for ep in results[1])
            stats["sandbox_episodes"] += len(results[1])
        stats["batches"] += 1

    try:
        await batch(0)  # warm-up: tokenizer caches, the verifier forkserver, connection pool
        await session.close()
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
        task.tools = tuple(_tools(session, url))
        loop.tools = {t.name: t for t in task.tools}
        await asyncio.sleep(0.2)
        proc = psutil.Process()
        before = _snapshot(proc)
        tasks_before = len(asyncio.all_tasks())
        start = time.monotonic()
        seed = 1
        while time.monotonic() - start < SOAK_S or stats["batches"] < 3:  # at least two measured batches
            await batch(seed)
            seed += 1
        elapsed = time.monotonic() - start
        await session.close()
        await asyncio.sleep(0.2)  # closed connections leave the loop's selector
        after = _snapshot(proc)
        tasks_after = len(asyncio.all_tasks())
    finally:
        if not session.closed:
            await session.close()
        await runner.cleanup()
    return before, after, tasks_before, tasks_after, stats, elapsed, sb_cfg


def test_soak_hundreds_of_concurrent_episodes_leak_nothing(tmp_path):
    with_sandbox = os.geteuid() == 0
    before, after, tasks_before, tasks_after, stats, elapsed, sb_cfg = asyncio.run(
        _soak(with_sandbox, tmp_path)
    )
    print(
        f"\nsoak: {stats['batches']} batches, {stats['episodes']} episodes "
        f"({NUM_PROMPTS * SAMPLES} concurrent) + {stats['sandbox_episodes']} sandbox episodes in "
        f"{elapsed:.1f} s; {stats['failed']} failed episodes (dropped groups), "
        f"{stats['tool_errors']} tool error observations; fds {before['fds']} -> {after['fds']}, "
        f"children {len(before['children'])} -> {len(after['children'])}, threads "
        f"{before['threads']} -> {after['threads']}, rss {before['rss_mib']:.1f} -> "
        f"{after['rss_mib']:.1f} MiB"
    )
    assert stats["batches"] >= 2 and stats["episodes"] >= 2 * NUM_PROMPTS * SAMPLES
    assert stats["failed"] > 0 and stats["tool_errors"] >= stats["episodes"]  # faults were hit
    assert after["fds"] == before["fds"], (before, after)
    assert after["children"] == before["children"], (before, after)
    assert after["threads"] <= before["threads"], (before, after)
    assert tasks_after == tasks_before
    assert after["rss_mib"] - before["rss_mib"] <= RSS_BOUND_MIB, (before, after)
    if sb_cfg is not None:
        assert stats["sandbox_episodes"] > 0
        assert _sandbox_leftovers(sb_cfg) == []
        os.rmdir(sb_cfg.root_dir)
    else:
        pytest.skip("soak ran without its sandbox episodes (not root); the rest passed")
