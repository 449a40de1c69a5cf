"""What a task is: instances (prompt, files to start from, container image), tools, a verifier.

The agent loop asks a task for the first messages of an episode, sets the instance's files up in
the episode's sandbox, lets the model act with the task's tools, then calls ``verify`` (through the
verifier pool) for the reward. ``scripted_turns`` is a fixed, correct sequence of assistant turns
for an instance, used by the scripted test/benchmark policy and by ``megathunder tasks check``
(the oracle); it is not part of training.

An instance from a benchmark carries what its harness gives it: its sandbox's
:class:`~megathunder.rollout.sandbox.Environment` (work directory, network, CPUs, memory, the image
to build), the agent's time limit (``agent_timeout_s``: Harbor's ``[agent] timeout_sec``,
Terminal-Bench 1's ``max_agent_timeout_sec``; it replaces ``agent.episode_wall_time_s``) and its
test run's (``test_timeout_s``). :class:`DatasetTask` holds a file's instances and can drop some
(``task.check_before_training``).
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megathunder.config import TestRunLimits
from megathunder.rollout.episode import Episode
from megathunder.rollout.sandbox import CommandLimits, Environment, ImageBuild, Sandbox
from megathunder.rollout.tools import Tool
from megathunder.rollout.verifiers import Verdict

__all__ = ["DatasetTask", "ImageBuild", "Task", "TaskInstance", "last_number", "tool_call_text"]


@dataclass(frozen=True)
class TaskInstance:
    instance_id: str
    prompt: str
    answer: Any = None
    files: Mapping[str, str | bytes] = field(
        default_factory=dict
    )  # relative path -> content, uploaded first
    image: str | None = None  # container image (cluster backends)
    environment: Environment | None = None  # what its sandbox must provide (None: nothing special)
    agent_timeout_s: float | None = None  # the agent's wall time (None: agent.episode_wall_time_s)
    test_timeout_s: float | None = None  # its test run's wall time (None: task.test_run.wall_time_s)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def build(self) -> ImageBuild | None:
        """How to build ``image`` where it is not pulled (task directories)."""
        return self.environment.build if self.environment is not None else None


class Task(abc.ABC):
    name: str
    system_prompt: str = "You are a helpful assistant."
    tools: tuple[Tool, ...] = ()
    verifies_in_sandbox: bool = False  # the verifier inspects the sandbox (even without tools)

    @property
    def needs_sandbox(self) -> bool:
        return self.verifies_in_sandbox or any(t.needs_sandbox for t in self.tools)

    @abc.abstractmethod
    def instances(self, num: int, seed: int = 0) -> list[TaskInstance]:
        """``num`` instances, reproducible from ``seed``."""

    def messages(self, inst: TaskInstance) -> list[dict[str, str]]:
        """The conversation's start; the tools' schemas are the codec's to render (``tool_schemas``)."""
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": inst.prompt}]

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools]

    async def setup(self, inst: TaskInstance, sandbox: Sandbox | None) -> None:
        if inst.files:
            assert sandbox is not None, f"task {self.name}: instance files need a sandbox"
            await sandbox.upload(inst.files)

    @abc.abstractmethod
    async def verify(self, inst: TaskInstance, episode: Episode, sandbox: Sandbox | None) -> float | Verdict:
        """The reward of a finished episode (may run commands in the episode's sandbox); a
        :class:`Verdict` adds the per-test outcome (kept in the journal)."""

    def scripted_turns(self, inst: TaskInstance) -> Sequence[str]:
        """A correct sequence of assistant turns (text, each ending the turn) for test policies."""
        raise NotImplementedError(f"task {self.name} has no scripted solution")

    def verifier_timeout_s(self, inst: TaskInstance, timeout_s: float) -> float:
        """The verifier pool's limit for ``inst``: ``timeout_s`` (``verifier.timeout_s``), plus the
        wall time of the test run it starts, for tasks that run one."""
        return timeout_s


class DatasetTask(Task):
    """Instances read from a benchmark's files, graded by a test run in the episode's sandbox under
    ``test_run`` limits (``task.test_run``; an instance's own test timeout replaces the wall time)."""

    verifies_in_sandbox = True

    def __init__(self, instances: Sequence[TaskInstance], test_run: TestRunLimits | None = None) -> None:
        self._all = list(instances)
        self.test_run = test_run or TestRunLimits()

    def instances(self, num: int, seed: int = 0) -> list[TaskInstance]:
        return [self._all[(seed + k) % len(self._all)] for k in range(num)]

    def all_instances(self) -> list[TaskInstance]:
        return list(self._all)

    def drop(self, instance_ids: Collection[str]) -> None:
        """Remove these instances (bad tasks a check found); keeping none is an error."""
        kept = [i for i in self._all if i.instance_id not in instance_ids]
        if not kept:
            raise ValueError(f"task {self.name}: no instance left after dropping {len(self._all)}")
        self._all = kept

    def test_limits(self, inst: TaskInstance) -> CommandLimits:
        t = self.test_run
        return CommandLimits(wall_time_s=inst.test_timeout_s or t.wall_time_s, cpu_time_s=t.cpu_time_s,
                             memory_mb=t.memory_mb, max_processes=t.max_processes,
                             max_output_bytes=t.max_output_bytes)

    def verifier_timeout_s(self, inst: TaskInstance, timeout_s: float) -> float:
        return timeout_s + self.test_limits(inst).wall_time_s


def tool_call_text(name: str, **arguments: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def last_number(text: str) -> float | None:
    """The last number in a response (the answer convention of the arithmetic tasks)."""
    found = re.findall(r"-?\d+(?:\.\d+)?", text)
    return float(found[-1]) if found else None
