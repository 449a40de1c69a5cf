"""Episode faults of ``chaos.faults`` (``megathunder.trainer.chaos.Chaos``, its episode part
installed around an agent loop: ``install_episodes``) on the scripted engine and the real local
sandbox: a crashed or hung verifier gives its trajectory ``verifier.on_failure``'s outcome and
nothing else changes; the episode's own first ``bash`` call, replaced by one that hangs past
``sandbox.wall_time_s`` or allocates past ``sandbox.memory_mb``, is stopped by the sandbox (an error
observation in the episode's transcript) and the episode goes on to its reward; a task without a
bash tool is refused by name; each fault is recorded once (``chaos.jsonl``) and a resumed run does
not fire it again. ``corrupt_journal``'s tear: the CRC drops exactly the torn record."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from megathunder.config import AgentLoopConfig, ChaosFault, VerifierConfig
from megathunder.rollout.agent_loop import AgentLoop
from megathunder.rollout.scripted import ScriptedPolicy
from megathunder.rollout.tasks.task import Task, TaskInstance, tool_call_text
from megathunder.rollout.tools import BASH
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


class _BashTask(_OkTask):
    """Every episode runs one bash call, then answers."""

    name = "bash_probe"
    tools = (BASH,)


def _batch(tmp_path, faults, *, step=0, policy="zero_reward", task=None):
    task, c = task or _OkTask(), codec()
    insts = task.instances(2)
    turns = [tool_call_text("bash", command="echo fine"), "ok"] if task.tools else ["ok"]
    verifier = VerifierConfig(timeout_s=1, on_failure=policy, failure_reward=-1.0)
    loop = AgentLoop(ScriptedPolicy(c, {i.prompt: turns for i in insts}), c, task, AgentLoopConfig(max_turns=3),
                     sandbox_cfg(tmp_path, wall_time_s=2, memory_mb=128), VerifierPool(verifier))
    chaos = Chaos([ChaosFault(**f) for f in faults], tmp_path)
    chaos.install_episodes(loop, loop.sandbox_cfg, verifier)
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
def test_an_episodes_own_tool_call_hung_or_memory_hungry_is_stopped_by_the_real_sandbox(tmp_path, caplog):
    faults = [{"kind": "hang_sandbox", "trajectories": [0]}, {"kind": "oom_tool", "trajectories": [3]}]
    with caplog.at_level("WARNING"):
        episodes, _, took = _batch(tmp_path, faults, task=_BashTask())
    assert took < 40  # killed at sandbox.wall_time_s (2 s), not slept out
    assert [e.reward.status for e in episodes] == ["ok"] * 4  # the episodes went on to their verifiers
    assert all(e.reward.reward == 1.0 and e.failure is None for e in episodes)
    observed = [e.turns[0].tool_runs[0].observation for e in episodes]  # each episode's own bash call
    assert "[error:" in observed[0] and "[error:" in observed[3], observed  # the faults took them
    assert "fine" in observed[1] and "fine" in observed[2], observed  # the others ran their own command
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chaos:")]
    assert any("hang_sandbox in trajectory 0" in m and "[error:" in m for m in said), said
    assert any("oom_tool in trajectory 3" in m and "[error:" in m for m in said), said


def test_a_tool_fault_on_a_task_without_a_bash_tool_is_refused_by_name(tmp_path):
    from megathunder.config import ConfigError

    with pytest.raises(ConfigError, match="chaos.faults.0.kind: oom_tool hits an episode's own bash tool call; "
                                          "task 'ok_probe' has no bash tool"):
        _batch(tmp_path, [{"kind": "oom_tool", "trajectories": [0]}])


def test_a_torn_last_record_is_dropped_by_its_crc(tmp_path):
    journal = Journal(tmp_path / "journal.jsonl")
    for step in range(3):
        journal.append({"type": "step", "step": step, "metrics": {"x": step}})
    journal.close()
    assert tear_last_record(tmp_path / "journal.jsonl") > 0
    assert [r["step"] for r in read_records(tmp_path / "journal.jsonl")] == [0, 1]
    Journal(tmp_path / "journal.jsonl", keep_steps=2).close()  # the resume's cut rewrites it whole
    assert (tmp_path / "journal.jsonl").read_text().count("\n") == 2
