"""Episode faults of ``chaos.faults`` (``megathunder.trainer.chaos.Chaos`` as the agent loop's
``EpisodeFaults``) on the scripted engine and the real local sandbox: a crashed or hung verifier
gives its trajectory ``verifier.on_failure``'s outcome and nothing else changes; a tool call that
hangs past ``sandbox.wall_time_s`` or allocates past ``sandbox.memory_mb`` is stopped by the sandbox
(an error observation) and the episode goes on to its ordinary reward; each fault is recorded
once (``chaos.jsonl``) and a resumed run does not fire it again. ``corrupt_journal``'s tear: the
CRC drops exactly the torn record."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from megathunder.config import AgentLoopConfig, ChaosFault, VerifierConfig
from megathunder.rollout.agent_loop import AgentLoop
from megathunder.rollout.scripted import ScriptedPolicy
from megathunder.rollout.tasks.task import Task, TaskInstance
from megathunder.rollout.verifiers import VerifierPool
from megathunder.trainer.chaos import RECORD, Chaos, tear_last_record
from megathunder.trainer.journal import Journal, read_records
from tests.rollout_helpers import codec, sandbox_cfg


class _OkTask(Task):
    name = "ok_probe"

    def instances(self, num, seed=0):
        return [TaskInstance(f"p-{k}", f"prompt {k}") for k in range(num)]

    async def verify(self, inst, episode, sandbox):
        return float("ok" in episode.final_text)


def _batch(tmp_path, faults, *, step=0, policy="zero_reward"):
    task, c = _OkTask(), codec()
    insts = task.instances(2)
    verifier = VerifierConfig(timeout_s=1, on_failure=policy, failure_reward=-1.0)
    loop = AgentLoop(ScriptedPolicy(c, {i.prompt: ["ok"] for i in insts}), c, task, AgentLoopConfig(max_turns=2),
                     sandbox_cfg(tmp_path, wall_time_s=2, memory_mb=128), VerifierPool(verifier))
    chaos = Chaos([ChaosFault(**f) for f in faults], tmp_path, engine=None,  # type: ignore[arg-type]
                  sandbox=loop.sandbox_cfg, verifier=verifier)
    loop.faults = chaos
    chaos.rollout_step = step
    start = time.monotonic()
    episodes = asyncio.run(loop.run_batch(insts, 2))
    return episodes, chaos, time.monotonic() - start


@pytest.mark.parametrize("policy", ["zero_reward", "drop_group"])
def test_crashed_and_hung_verifiers_follow_on_failure_only_for_their_trajectories(tmp_path, policy):
    faults = [{"kind": "crash_verifier", "trajectories": [1]}, {"kind": "hang_verifier", "trajectories": [2, 3]}]
    episodes, chaos, took = _batch(tmp_path, faults, policy=policy)
    assert took < 30  # the hung verifier was cancelled at verifier.timeout_s, not waited for
    status = [e.reward.status for e in episodes]
    assert status == ["ok", "error", "timeout", "timeout"]
    assert "chaos: crash_verifier" in episodes[1].failure
    assert episodes[0].reward.reward == 1.0 and episodes[0].failure is None
    for e in episodes[1:]:
        assert e.reward.drop_group == (policy == "drop_group")
        assert e.reward.reward == (None if policy == "drop_group" else -1.0)
    fired = [json.loads(line) for line in (tmp_path / RECORD).read_text().splitlines()]
    assert [f["kind"] for f in fired] == ["crash_verifier", "hang_verifier"]  # once each, for all its trajectories
    again, _, _ = _batch(tmp_path, faults, policy=policy)  # a resumed run: already fired
    assert [e.reward.status for e in again] == ["ok"] * 4


def test_faults_of_another_step_do_not_fire(tmp_path):
    episodes, chaos, _ = _batch(tmp_path, [{"kind": "crash_verifier", "step": 1}], step=0)
    assert [e.reward.status for e in episodes] == ["ok"] * 4 and len(chaos.pending) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="the local sandbox's uids and cgroups need root")
def test_hung_and_memory_hungry_tool_calls_are_stopped_by_the_real_sandbox(tmp_path, caplog):
    faults = [{"kind": "hang_sandbox", "trajectories": [0]}, {"kind": "oom_tool", "trajectories": [3]}]
    with caplog.at_level("WARNING"):
        episodes, _, took = _batch(tmp_path, faults)
    assert took < 40  # killed at sandbox.wall_time_s (2 s), not slept out
    assert [e.reward.status for e in episodes] == ["ok"] * 4  # the episodes went on, unchanged
    assert all(e.reward.reward == 1.0 and e.failure is None for e in episodes)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chaos:")]
    assert any("hang_sandbox in trajectory 0" in m and "[error:" in m for m in said), said
    assert any("oom_tool in trajectory 3" in m and "[error:" in m for m in said), said


def test_a_torn_last_record_is_dropped_by_its_crc(tmp_path):
    journal = Journal(tmp_path / "journal.jsonl")
    for step in range(3):
        journal.append({"type": "step", "step": step, "metrics": {"x": step}})
    journal.close()
    assert tear_last_record(tmp_path / "journal.jsonl") > 0
    assert [r["step"] for r in read_records(tmp_path / "journal.jsonl")] == [0, 1]
    Journal(tmp_path / "journal.jsonl", keep_steps=2).close()  # the resume's cut rewrites it whole
    assert (tmp_path / "journal.jsonl").read_text().count("\n") == 2
