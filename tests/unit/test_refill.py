"""DAPO's refill in the agent loop (``AgentLoop.run_batch(refill=...)``): whatever order groups finish
in, the groups run are the shortest prefix of the prompt sequence with the batch's number of kept
groups (or the budget's end), each replacement announced before any of its episodes starts."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from megathunder.rollout.agent_loop import AgentLoop, Refill


@dataclass
class FakeEpisode:
    traj_id: int
    group_id: int
    instance: int
    failure: str | None = None


def loop_with(delays: random.Random, started: list[int], announced: dict[int, int]) -> AgentLoop:
    loop = AgentLoop.__new__(AgentLoop)  # only run_batch's own logic is under test
    loop.task = SimpleNamespace(needs_sandbox=False)

    async def run_episode(inst, *, traj_id, group_id, seed=None):
        started.append(group_id)
        assert group_id < 4 or announced.get(group_id) is not None, "a replacement started before it was announced"
        await asyncio.sleep(delays.random() * 0.002)
        return FakeEpisode(traj_id, group_id, inst)

    loop.run_episode = run_episode
    return loop


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("budget", [0, 3, 100])
def test_refill_runs_the_shortest_prefix_with_enough_kept_groups(seed, budget):
    rng = random.Random(seed)
    drops = [rng.random() < 0.5 for _ in range(200)]  # whether the group on prompt i is dropped
    started: list[int] = []
    announced: dict[int, int] = {}

    def announce(group_id, traj_ids):
        assert traj_ids == [group_id * 2, group_id * 2 + 1]
        announced[group_id] = len(started)

    refill = Refill(budget, instance=lambda j: 4 + j, dropped=lambda members: drops[members[0].instance],
                    announce=announce)
    episodes = asyncio.run(loop_with(rng, started, announced).run_batch([0, 1, 2, 3], 2, seed=1, refill=refill))
    groups = sorted({e.group_id for e in episodes})
    assert [e.traj_id for e in episodes] == list(range(2 * len(groups)))  # trajectory order, none missing
    assert all(e.instance == e.group_id for e in episodes)  # group 4 + j runs replacement j's prompt
    length, kept = 4, sum(not d for d in drops[:4])
    while kept < 4 and length < 4 + budget:  # the reference: extend the prefix until 4 are kept
        kept += not drops[length]
        length += 1
    assert groups == list(range(length))
    assert set(announced) == set(range(4, length))


def test_no_more_prompts_stops_the_refill():
    started: list[int] = []
    refill = Refill(10, instance=lambda j: None, dropped=lambda members: True, announce=lambda g, t: None)
    episodes = asyncio.run(loop_with(random.Random(0), started, {}).run_batch([0, 1], 1, refill=refill))
    assert sorted(e.group_id for e in episodes) == [0, 1]


def test_an_episode_that_raises_stops_the_batch_and_cancels_the_rest():
    loop = AgentLoop.__new__(AgentLoop)
    loop.task = SimpleNamespace(needs_sandbox=False)
    cancelled: list[int] = []

    async def run_episode(inst, *, traj_id, group_id, seed=None):
        if traj_id == 0:
            raise RuntimeError("boom")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(traj_id)
            raise

    loop.run_episode = run_episode
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(asyncio.wait_for(loop.run_batch([0, 1], 2), timeout=5))
    assert sorted(cancelled) == [1, 2, 3]
