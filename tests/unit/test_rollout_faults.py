"""Fault policies of the rollout side (RELIABILITY.md): every fault ends in a defined, recorded
outcome. A failed episode carries ``Episode.failure`` and the ``verifier.on_failure`` outcome
(``drop_group`` in its reward event, or ``failure_reward``); nothing non-finite reaches an event
the trainer feeds to the ledger."""

from __future__ import annotations

import asyncio
import math

import pytest

from megathunder.config import AgentLoopConfig, ConfigError, LocalSandboxConfig, VerifierConfig, load_config
from megathunder.rollout.agent_loop import AgentLoop
from megathunder.rollout.scripted import ScriptedPolicy
from megathunder.rollout.types import Completion
from megathunder.rollout.verifiers import VerifierPool
from megathunder.rollout.tasks.task import Task, TaskInstance, tool_call_text
from tests.rollout_helpers import codec


class _AnswerTask(Task):
    """No tools, no sandbox: reward 1 when the answer says 'ok', or what ``verify`` returns."""

    name = "answer_probe"

    def __init__(self, verify=None) -> None:
        self._verify = verify
        self.num_verified = 0

    def instances(self, num, seed=0):
        return [TaskInstance(f"p-{k}", f"prompt {k}") for k in range(num)]

    async def verify(self, inst, episode, sandbox):
        self.num_verified += 1
        if self._verify is not None:
            return await self._verify(inst)
        return float("ok" in episode.final_text)


class _FaultyEngine(ScriptedPolicy):
    """The scripted policy, with ``corrupt(prompt_text, turn, completion)`` applied to outputs."""

    def __init__(self, codec_, scripts, corrupt) -> None:
        super().__init__(codec_, scripts)
        self.corrupt = corrupt

    async def generate(self, prompt_token_ids, params, *, session_id=None) -> Completion:
        out = await super().generate(prompt_token_ids, params, session_id=session_id)
        text = self.codec.decode(prompt_token_ids)
        turn = text.count("<|im_start|>assistant\n") - 1
        return self.corrupt(text, turn, out)


def _run(task, engine_factory, *, num_prompts=2, samples=2, verifier=None, scripts=None):
    c = codec()
    insts = task.instances(num_prompts)
    scripts = scripts or {i.prompt: [tool_call_text("nope"), "ok"] for i in insts}
    engine = engine_factory(c, scripts)
    events = []
    loop = AgentLoop(
        engine, c, task, AgentLoopConfig(max_total_tokens=4096, max_new_tokens_per_turn=512),
        LocalSandboxConfig(), VerifierPool(VerifierConfig(**{"timeout_s": 5, **(verifier or {})})),
        emit=events.append,
    )  # fmt: skip
    episodes = asyncio.run(loop.run_batch(insts, samples, seed=3))
    return episodes, events


def _finite_payloads(events) -> bool:
    for ev in events:
        if ev.kind == "turn_finished" and not all(map(math.isfinite, ev.payload["logprobs"])):
            return False
        if ev.kind == "reward":
            r = ev.payload["reward"]
            if r is None and not ev.payload["drop_group"]:
                return False
            if r is not None and not math.isfinite(r):
                return False
    return True


@pytest.mark.parametrize("policy", ["drop_group", "zero_reward"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_logprob_fails_the_episode(bad, policy):
    def corrupt(text, turn, out):
        if "prompt 1" in text and turn == 1:  # the second turn of group 1's episodes
            lps = list(out.logprobs)
            lps[len(lps) // 2] = bad
            return Completion(out.token_ids, lps, out.finish_reason, out.policy_version)
        return out

    task = _AnswerTask()
    verifier = {"on_failure": policy, "failure_reward": -1.0}
    episodes, events = _run(task, lambda c, s: _FaultyEngine(c, s, corrupt), verifier=verifier)
    ok, failed = episodes[:2], episodes[2:]
    drop = policy == "drop_group"
    assert all(e.failure is None and e.reward.reward == 1.0 for e in ok)
    for ep in failed:
        assert ep.failure.startswith(f"nonfinite_logprob: {bad}") and "(turn 1)" in ep.failure
        assert ep.stop_reason == "failed" and len(ep.turns) == 1  # the bad turn is not kept
        assert all(map(math.isfinite, ep.rollout_logprobs))
        assert ep.reward.status == "skipped" and ep.reward.drop_group == drop
        assert ep.reward.reward == (None if drop else -1.0)
        assert ep.to_trajectory().num_targets == len(ep.token_ids) - 1  # trainable prefix
    assert task.num_verified == 2  # the failed episodes' verifier never ran
    rewards = {e.traj_id: e.payload for e in events if e.kind == "reward"}
    assert [rewards[t]["drop_group"] for t in range(4)] == [False, False, drop, drop]
    finished = {e.traj_id: e.payload["failure"] for e in events if e.kind == "trajectory_finished"}
    assert finished[0] is None and finished[2] == failed[0].failure
    turns = [(e.traj_id, e.turn_index) for e in events if e.kind == "turn_finished"]
    assert (2, 1) not in turns and (2, 0) in turns and (0, 1) in turns
    assert _finite_payloads(events)


def test_logprob_count_mismatch_is_a_protocol_failure():
    def corrupt(text, turn, out):
        return Completion(out.token_ids, out.logprobs[:-1], out.finish_reason, out.policy_version)

    episodes, _ = _run(_AnswerTask(), lambda c, s: _FaultyEngine(c, s, corrupt), num_prompts=1)
    assert all(e.failure.startswith("engine_protocol: ") for e in episodes)


@pytest.mark.parametrize("policy", ["zero_reward", "drop_group"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, "raise", "hang", "not a number"])
def test_verifier_faults_follow_on_failure(policy, bad):
    async def verify(inst):
        if inst.instance_id != "p-0":
            return 1.0
        if bad == "raise":
            raise RuntimeError("grader crashed")
        if bad == "hang":
            await asyncio.sleep(3600)
        return bad

    verifier = {"timeout_s": 0.3, "on_failure": policy, "failure_reward": -0.5}
    episodes, events = _run(_AnswerTask(verify), lambda c, s: ScriptedPolicy(c, s), verifier=verifier)
    hit, fine = episodes[:2], episodes[2:]
    assert all(e.failure is None and e.reward.reward == 1.0 for e in fine)
    status = "timeout" if bad == "hang" else "error"
    for ep in hit:
        assert ep.reward.status == status and ep.failure.startswith(f"verifier_{status}: ")
        if policy == "drop_group":
            assert ep.reward.drop_group and ep.reward.reward is None
        else:
            assert not ep.reward.drop_group and ep.reward.reward == -0.5
    assert _finite_payloads(events)


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_failure_reward_is_a_config_error(value):
    with pytest.raises(ConfigError, match="verifier.failure_reward"):
        load_config(None, [f"verifier.failure_reward={value}"])


def test_engine_error_ends_the_batch_and_cancels_the_other_episodes():
    started, cancelled = [], []

    class Dying(ScriptedPolicy):
        async def generate(self, prompt_token_ids, params, *, session_id=None):
            text = self.codec.decode(prompt_token_ids)
            if "prompt 0" in text:
                await asyncio.sleep(0.05)
                raise RuntimeError("no rollout server left")
            started.append(text)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(text)
                raise

    async def go():
        c = codec()
        task = _AnswerTask()
        insts = task.instances(3)
        loop = AgentLoop(
            Dying(c, {i.prompt: ["ok"] for i in insts}), c, task, AgentLoopConfig(),
            LocalSandboxConfig(), VerifierPool(VerifierConfig()),
        )  # fmt: skip
        with pytest.raises(RuntimeError, match="no rollout server left"):
            await asyncio.wait_for(loop.run_batch(insts, 2), 10)
        await asyncio.sleep(0)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return others

    assert asyncio.run(go()) == []  # nothing left running
    assert len(started) == 4 and len(cancelled) == 4


class _FakeSandbox:
    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("where", ["build", "setup"])
def test_a_sandbox_that_cannot_be_set_up_fails_its_episode_not_the_batch(monkeypatch, where):
    """A sandbox that cannot be built (or whose files cannot be uploaded) fails that episode with
    ``sandbox_error`` and the configured outcome; the rest of the batch trains as usual, every
    built sandbox is closed; a batch where no sandbox could be set up is an error."""
    import megathunder.rollout.agent_loop as agent_loop
    from megathunder.rollout.sandbox import SandboxError

    built = []

    def broken(inst) -> bool:
        return inst.instance_id in task.broken

    async def build_sandbox(cfg, image=None, **environment):
        if where == "build" and image == "broken":
            raise SandboxError("container start failed")
        built.append(_FakeSandbox())
        return built[-1]

    class Task_(_AnswerTask):
        needs_sandbox = True
        broken: set[str] = {"p-1"}

        def instances(self, num, seed=0):
            return [TaskInstance(f"p-{k}", f"prompt {k}", image="broken" if f"p-{k}" in self.broken else None)
                    for k in range(num)]  # fmt: skip

        async def setup(self, inst, sandbox):
            if where == "setup" and broken(inst):
                raise SandboxError("upload of 1 files failed")

    monkeypatch.setattr(agent_loop, "build_sandbox", build_sandbox)
    task = Task_()
    episodes, events = _run(task, ScriptedPolicy, num_prompts=3, samples=2, scripts={
        f"prompt {k}": ["ok"] for k in range(3)}, verifier={"on_failure": "drop_group"})  # fmt: skip
    failed = [e for e in episodes if e.failure]
    assert [e.instance_id for e in failed] == ["p-1", "p-1"]
    assert all(e.failure.startswith(agent_loop.SANDBOX_FAILURE) and not e.turns for e in failed)
    rewards = {ev.traj_id: ev.payload for ev in events if ev.kind == "reward"}
    assert all(rewards[e.traj_id]["drop_group"] for e in failed)
    assert [rewards[e.traj_id]["reward"] for e in episodes if not e.failure] == [1.0] * 4
    assert built and all(sb.closed for sb in built)

    task.broken = {"p-0", "p-1", "p-2"}
    with pytest.raises(SandboxError, match="no sandbox of the batch could be set up"):
        _run(task, ScriptedPolicy, num_prompts=3, samples=2, scripts={f"prompt {k}": ["ok"] for k in range(3)})


def test_fault_outcomes_are_deterministic_given_the_seed():
    """The same batch (seed, scripts, faults) gives the same failures, stop reasons and rewards."""

    def corrupt(text, turn, out):
        if out.token_ids and out.token_ids[0] % 3 == 0 and turn == 0:
            return Completion(out.token_ids, [math.nan] * len(out.token_ids), out.finish_reason, 0)
        return out

    def once():
        task = _AnswerTask()
        scripts = {f"prompt {k}": [f"{k} ok"] for k in range(6)}
        eps, _ = _run(task, lambda c, s: _FaultyEngine(c, s, corrupt), num_prompts=6, scripts=scripts)
        return [(e.traj_id, e.failure, e.stop_reason, e.reward.reward) for e in eps]

    first = once()
    assert first == once()
    assert {f is None for _, f, _, _ in first} == {True, False}  # both outcomes occur


# --- budgets, malformed calls and sandbox faults: outcomes of a trainable episode, not failures ---


def test_token_and_time_budgets_end_the_episode_without_failing_it():
    task = _AnswerTask()
    (inst,) = task.instances(1)
    c = codec()
    long_turn = "word " * 400

    def run(agent, seconds_per_token):
        loop = AgentLoop(
            ScriptedPolicy(c, {inst.prompt: [long_turn]}, seconds_per_token=seconds_per_token),
            c, task, AgentLoopConfig(**agent), LocalSandboxConfig(), VerifierPool(VerifierConfig()),
        )  # fmt: skip
        return asyncio.run(loop.run_batch([inst], 1))[0]

    ep = run({"max_total_tokens": 300, "max_new_tokens_per_turn": 100}, 0.0)
    assert ep.stop_reason == "max_tokens" and ep.truncated and len(ep.token_ids) <= 300
    assert ep.failure is None and ep.reward.status == "ok" and not ep.reward.drop_group

    import time

    start = time.monotonic()
    ep = run({"episode_wall_time_s": 0.3}, 0.01)  # the turn would take ~4 s
    assert time.monotonic() - start < 2 and ep.stop_reason == "wall_time"
    assert ep.failure is None and ep.reward.status == "ok" and ep.reward.reward == 0.0


def test_malformed_tool_calls_are_observations_not_failures():
    from megathunder.rollout.tools import CALCULATOR

    task = _AnswerTask()
    task.tools = (CALCULATOR,)
    (inst,) = task.instances(1)
    script = [
        "<tool_call>{not json</tool_call>", "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"name": "calculator", "arguments": "[1]"}</tool_call>',
        '<tool_call>{"name": "calculator"}</tool_call>', "</tool_call> stray",
        '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(1)"}}</tool_call>',
        "<tool_call>" * 3, "ok",
    ]  # fmt: skip
    episodes, events = _run(task, lambda c, s: ScriptedPolicy(c, s), num_prompts=1, samples=1,
                            scripts={inst.prompt: script})  # fmt: skip
    (ep,) = episodes
    runs = [r for t in ep.turns for r in t.tool_runs]
    assert len(ep.turns) == len(script) and len(runs) >= 7
    assert all(r.observation.startswith("[error: ") and not r.ok for r in runs)
    assert ep.failure is None and ep.stop_reason == "answered" and ep.reward.reward == 1.0


def test_hanging_and_memory_hungry_sandbox_commands_with_the_real_sandbox(tmp_path):
    """In the real local sandbox: a tool that hangs or exhausts memory is an error observation;
    a verifier whose sandbox command hangs times out and follows verifier.on_failure."""
    import os
    import time

    from megathunder.rollout.tools import BASH
    from tests.rollout_helpers import needs_root, sandbox_cfg

    if os.geteuid() != 0:
        pytest.skip(needs_root.kwargs["reason"])

    class SandboxTask(_AnswerTask):
        tools = (BASH,)

        async def verify(self, inst, episode, sandbox):
            out = await sandbox.shell("sleep 600")  # hangs past the verifier's timeout
            return float(out.ok)

    from megathunder.rollout.sandbox.cgroups import create_cgroup

    probe = create_cgroup("auto", 1 << 30, 16)
    has_cgroup = probe is not None
    if probe is not None:
        probe.remove()
    task = SandboxTask()
    (inst,) = task.instances(1)
    script = [
        tool_call_text("bash", command="sleep 600"),
        tool_call_text("bash", command="python3 -c 'x = bytearray(1 << 30)'"),
        tool_call_text(  # 4 x 100 MiB held at once (sleep: they overlap even on a loaded machine)
            "bash", command="for i in 1 2 3 4; do python3 -c \"import time; b = b'1' * (100 << 20); "
            "time.sleep(1)\" & done; wait"),
        "ok",
    ]  # fmt: skip
    c = codec()
    for policy, turns in (("zero_reward", script), ("drop_group", ["ok"])):
        loop = AgentLoop(
            ScriptedPolicy(c, {inst.prompt: turns}), c, task, AgentLoopConfig(max_turns=6),
            sandbox_cfg(tmp_path, wall_time_s=8, memory_mb=192),
            VerifierPool(VerifierConfig(timeout_s=1, on_failure=policy, failure_reward=0.0)),
        )  # fmt: skip
        start = time.monotonic()
        (ep,) = asyncio.run(loop.run_batch([inst], 1))
        assert time.monotonic() - start < 60  # the hung commands were killed, not waited for
        assert ep.stop_reason == "answered" and ep.reward.status == "timeout"
        assert ep.failure.startswith("verifier_timeout: ")  # the verifier's `sleep 600`
        assert ep.reward.reward == (None if policy == "drop_group" else 0.0)
        if policy == "zero_reward":
            hang, oom, many = [r.observation for t in ep.turns for r in t.tool_runs]
            assert "[error: command killed: wall-time limit of 8 s exceeded]" in hang
            assert "MemoryError" in oom and "[error: " in oom
            if has_cgroup:  # the sandbox's cgroup bounds the tree's sum (4 x 100 MiB > 192 MiB)
                assert "memory limit of 192 MiB was exceeded" in many, many


def test_evaluation_counts_a_failed_episode_as_missing():
    """eval: an episode failed by non-finite logprobs is a missing sample (episode_error), not a
    scored one (and not a crash of the evaluation)."""
    from megathunder.config import load_config
    from megathunder.eval import evaluate
    from megathunder.rollout.tasks import build_task

    cfg = load_config(None, ["task.name=arithmetic"])
    task = build_task(cfg.task)
    insts = task.instances(2, seed=5)
    c = codec()

    def corrupt(text, turn, out):
        if insts[0].prompt in text:
            return Completion(out.token_ids, [math.nan] * len(out.token_ids), "stop", 0)
        return out

    engine = _FaultyEngine(c, {i.prompt: task.scripted_turns(i) for i in insts}, corrupt)
    result = asyncio.run(evaluate(cfg, engine, c, task, insts, k=2, temperature=1.0))
    first, second = result.instances
    assert [s.status for s in first.samples] == ["episode_error"] * 2
    assert all(s.reward is None and "nonfinite_logprob" in s.detail for s in first.samples)
    assert [s.status for s in second.samples] == ["ok"] * 2 and second.num_correct == 2


def test_a_paused_loop_starts_no_turn_and_its_episodes_keep_their_time():
    """``AgentLoop.pause`` (the trainer's evaluation): an episode reaching a turn while it is closed
    asks the engine nothing until it opens, and the wait is not its wall time -- paused for three
    times ``episode_wall_time_s``, it still ends with its answer, not at the deadline."""
    task = _AnswerTask()
    (inst,) = task.instances(1)
    c = codec()
    engine = ScriptedPolicy(c, {inst.prompt: [tool_call_text("nope"), "ok"]})
    calls = []
    generate = engine.generate

    async def counted(*args, **kwargs):
        calls.append(loop.pause.closed)
        return await generate(*args, **kwargs)

    engine.generate = counted  # type: ignore[method-assign]
    loop = AgentLoop(engine, c, task, AgentLoopConfig(episode_wall_time_s=1.0), LocalSandboxConfig(),
                     VerifierPool(VerifierConfig()))

    async def main():
        async with loop.pause:
            batch = asyncio.create_task(loop.run_batch([inst], 1))
            await asyncio.sleep(3.0)
            assert not calls and not batch.done()
        return await asyncio.wait_for(batch, timeout=30)

    (ep,) = asyncio.run(main())
    assert calls == [False, False]  # both turns asked once the pause had ended
    assert ep.stop_reason != "wall_time" and ep.reward.reward == 1.0
