"""Request priorities (``megathunder.rollout.priority``): what each scheduling policy gives a turn."""

from __future__ import annotations

import asyncio

import pytest

from megathunder.config import AgentLoopConfig, LocalSandboxConfig, VerifierConfig, load_config
from megathunder.rollout.agent_loop import AgentLoop
from megathunder.rollout.engines.common import engine_kwargs
from megathunder.rollout.priority import Priorities
from megathunder.rollout.tasks.arithmetic import ArithmeticTask
from megathunder.rollout.types import Completion
from megathunder.rollout.verifiers import VerifierPool
from tests.rollout_helpers import codec as make_codec


def test_fifo_is_all_zero():
    p = Priorities("fifo")
    p.started(0, 0)
    assert p.of(0, 0) == 0


def test_trajectory_start_keeps_an_episode_s_place_at_every_turn():
    p = Priorities("trajectory_start")
    for tid in range(4):
        p.started(tid, tid // 2)
    p.finished(0, 0)
    p.started(4, 2)
    assert [p.of(t, t // 2) for t in (1, 2, 3, 4)] == [1, 2, 3, 4]  # start order, unchanged by others finishing


def test_group_aware_puts_the_group_nearest_to_closing_first():
    p = Priorities("group_aware")
    for tid in range(6):  # groups 0, 1, 2 of two members each, started in that order
        p.started(tid, tid // 2)
    p.finished(3, 1)  # group 1 has one member left: its straggler goes first
    order = sorted([0, 1, 2, 4, 5], key=lambda t: p.of(t, t // 2))
    assert order == [2, 0, 1, 4, 5]
    p.finished(0, 0)
    p.finished(1, 0)
    p.finished(1, 0)  # twice: counted once
    assert p.of(2, 1) < p.of(4, 2)


def test_engine_runs_priority_scheduling_only_when_asked():
    cfg = load_config(None, [])
    assert "scheduling_policy" not in engine_kwargs(cfg.rollout.engine)
    cfg = load_config(None, ["rollout.engine.scheduling=group_aware"])
    assert engine_kwargs(cfg.rollout.engine)["scheduling_policy"] == "priority"
    with pytest.raises(Exception, match="rollout.engine.scheduling"):
        load_config(None, ["rollout.engine.scheduling=lifo"])


def test_the_agent_loop_sends_each_turn_s_priority():
    """Two groups of two one-turn episodes: every request carries the policy's priority."""
    seen: list[tuple[int, int]] = []

    class Engine:
        policy_version = 0

        async def generate(self, prompt, params, *, session_id=None):
            seen.append((len(seen), params.priority))
            await asyncio.sleep(0)
            return Completion(token_ids=[codec.end_of_turn_id], logprobs=[-0.5], finish_reason="stop", policy_version=0)

    codec = make_codec()
    task = ArithmeticTask()
    loop = AgentLoop(Engine(), codec, task, AgentLoopConfig(max_turns=1), LocalSandboxConfig(),
                     VerifierPool(VerifierConfig()), scheduling="trajectory_start")
    episodes = asyncio.run(loop.run_batch(task.instances(2, seed=0), 2, seed=1))
    assert len(episodes) == 4
    assert sorted(priority for _, priority in seen) == [0, 1, 2, 3]
