"""Shared machinery for the rollout tests: a real (locally trained) tokenizer, the scripted test
policy, and an agent loop with small limits."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Mapping, Sequence

import pytest

from megathunder.config import AgentLoopConfig, LocalSandboxConfig, VerifierConfig
from megathunder.rollout.agent_loop import AgentLoop
from megathunder.rollout.episode import Episode, RolloutEvent
from megathunder.rollout.chat import ChatMLCodec
from megathunder.models.local_tokenizer import train_local_chatml_tokenizer
from megathunder.rollout.scripted import ScriptedPolicy
from megathunder.rollout.verifiers import VerifierPool
from megathunder.rollout.tasks.task import Task, TaskInstance

ISOLATIONS = [
    pytest.param(
        "bwrap",
        marks=pytest.mark.skipif(
            shutil.which("bwrap") is None,
            reason="bubblewrap not installed (apt-get install -y bubblewrap)",
        ),
    ),
    "unshare",
]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the local sandbox needs root")


def codec() -> ChatMLCodec:
    return ChatMLCodec(train_local_chatml_tokenizer())


def sandbox_cfg(tmp_path, **kw) -> LocalSandboxConfig:
    del tmp_path  # below /tmp, not pytest's 0700 tmp_path: bwrap runs as the sandbox uid
    defaults = dict(
        root_dir="/tmp/megathunder-test-sandboxes",
        wall_time_s=5,
        cpu_time_s=2,
        memory_mb=256,
        max_processes=16,
    )
    return LocalSandboxConfig(**{**defaults, **kw})


def run_scripted(
    task: Task,
    instances: Sequence[TaskInstance],
    tmp_path,
    *,
    scripts: Mapping[str, Sequence[str]] | None = None,
    samples_per_prompt: int = 1,
    agent: Mapping | None = None,
    sandbox: Mapping | None = None,
    verifier: Mapping | None = None,
    seconds_per_token: float = 0.0,
) -> tuple[list[Episode], list[RolloutEvent]]:
    """Run ``instances`` with the scripted policy (default: the task's correct scripts)."""
    c = codec()
    scripts = scripts or {i.prompt: task.scripted_turns(i) for i in instances}
    policy = ScriptedPolicy(c, scripts, seconds_per_token=seconds_per_token)
    events: list[RolloutEvent] = []
    loop = AgentLoop(
        policy, c, task,
        AgentLoopConfig(**{"max_total_tokens": 8192, "max_new_tokens_per_turn": 1024, **(agent or {})}),
        sandbox_cfg(tmp_path, **(sandbox or {})),
        VerifierPool(VerifierConfig(**{"timeout_s": 10, **(verifier or {})})),
        emit=events.append,
    )  # fmt: skip
    episodes = asyncio.run(loop.run_batch(instances, samples_per_prompt))
    return episodes, events
