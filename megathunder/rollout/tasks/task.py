"""What a task is: instances (prompt, files to start from, container image), tools, a verifier.

The agent loop asks a task for the first messages of an episode, sets the instance's files up in
the episode's sandbox, lets the model act with the task's tools, then calls ``verify`` (through the
verifier pool) for the reward. ``scripted_turns`` is a fixed, correct sequence of assistant turns
for an instance, used by the scripted test/benchmark policy; it is not part of training.
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megathunder.rollout.episode import Episode
from megathunder.rollout.sandbox import Sandbox
from megathunder.rollout.tools import Tool
from megathunder.rollout.verifiers import Verdict


@dataclass(frozen=True)
class ImageBuild:
    """A task's own environment: ``docker build -f dockerfile context`` (tagged ``image``), or
    a docker-compose file whose ``client`` service is the agent's container."""

    context: str  # directory on this machine
    dockerfile: str | None = None  # path on this machine; None with a compose file
    compose_file: str | None = None


@dataclass(frozen=True)
class TaskInstance:
    instance_id: str
    prompt: str
    answer: Any = None
    files: Mapping[str, str | bytes] = field(
        default_factory=dict
    )  # relative path -> content, uploaded first
    image: str | None = None  # container image (cluster backends)
    build: ImageBuild | None = None  # how to build ``image`` where it is not pulled (task directories)
    metadata: Mapping[str, Any] = field(default_factory=dict)


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


def tool_call_text(name: str, **arguments: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def last_number(text: str) -> float | None:
    """The last number in a response (the answer convention of the arithmetic tasks)."""
    found = re.findall(r"-?\d+(?:\.\d+)?", text)
    return float(found[-1]) if found else None
