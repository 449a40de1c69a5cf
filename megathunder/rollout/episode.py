"""An episode as the agent loop builds it, and the events it emits while building it.

``Episode`` is one trajectory with its turn boundaries, tool runs, timings, reward and failure;
``RolloutEvent`` is what reaches the trainer as it happens: ``turn_finished`` (a model turn was
generated; its tool calls start now), ``trajectory_finished`` and ``reward``. Tasks and
verifiers type against this module; the agent loop (``megathunder.rollout.agent_loop``) fills it.
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from megathunder.rollout.types import FinishReason
from megathunder.rollout.verifiers import SANDBOX_FAILURE_PREFIX, RewardOutcome
from megathunder.trajectory import Trajectory

SANDBOX_FAILURE = SANDBOX_FAILURE_PREFIX

CURRENT_EPISODE: ContextVar[Episode] = ContextVar("megathunder_episode")
"""The episode the running code belongs to (set by ``AgentLoop.run_episode`` for its tool calls and
verifier): what a wrapper installed around a tool or the verifiers (``megathunder.trainer.chaos``)
reads to know which trajectory a call is for."""
"""Prefix of ``Episode.failure`` when the episode's sandbox could not be built or set up."""

StopReason = Literal["answered", "max_turns", "max_tokens", "wall_time", "engine_abort", "failed"]


@dataclass
class ToolRun:
    name: str
    arguments: dict | None  # None when the call could not be parsed
    observation: str
    duration_s: float
    ok: bool


@dataclass
class Turn:
    index: int
    start: int  # position of the turn's first generated token in ``token_ids``
    end: int  # one past its last generated token
    finish_reason: FinishReason
    policy_version: int
    started_at: float  # time.monotonic()
    generated_at: float
    tools_done_at: float | None = None
    tool_runs: list[ToolRun] = field(default_factory=list)

    @property
    def generation_s(self) -> float:
        return self.generated_at - self.started_at

    @property
    def tool_s(self) -> float:
        return 0.0 if self.tools_done_at is None else self.tools_done_at - self.generated_at


@dataclass
class Episode:
    """One trajectory as the agent loop built it, with turn boundaries and timings."""

    traj_id: int
    group_id: int
    instance_id: str
    prompt_len: int
    token_ids: list[int]
    loss_mask: list[bool]  # per target: len(token_ids) - 1
    rollout_logprobs: list[float]  # per target; 0.0 where masked
    turns: list[Turn] = field(default_factory=list)
    stop_reason: StopReason | None = None
    truncated: bool = False
    started_at: float = 0.0
    setup_s: float = 0.0
    """Seconds from the episode's creation to its first turn: its sandbox built and the task set up
    in it (``started_at`` is when the first turn starts)."""
    finished_at: float = 0.0
    rewarded_at: float | None = None
    """When the reward event was emitted: after any added verifier latency and the verifier pool's
    queue, which ``reward.duration_s`` (the verifier's own run) leaves out."""
    reward: RewardOutcome | None = None
    final_text: str = ""  # the last model turn, decoded
    routed_experts: np.ndarray | None = None
    """[len(token_ids) - 1, layers, top_k]: the engine's experts for each input position (routing
    replay; ``rollout.engine.record_routing``), fetched when the episode's last turn is done."""
    failure: str | None = None
    """What failed ("nonfinite_logprob: ...", "engine_protocol: ...", "verifier_error: ...",
    "verifier_timeout: ..."), None when nothing did. What the trainer does about it is
    ``reward.drop_group`` (``verifier.on_failure``). Final once the reward event is emitted."""

    @property
    def generation_s(self) -> float:
        return sum(t.generation_s for t in self.turns)

    @property
    def tool_s(self) -> float:
        return sum(t.tool_s for t in self.turns)

    @property
    def policy_versions(self) -> set[int]:
        return {t.policy_version for t in self.turns}

    @property
    def trained_reward(self) -> float | None:
        """The reward the learner trains on; None when the episode failed with ``drop_group``
        (its group leaves the batch) or has no finite reward."""
        return None if self.reward is None else trained_reward(self.reward.as_payload())

    @property
    def reward_time(self) -> float:
        """When its reward was emitted (``time.monotonic()``)."""
        if self.rewarded_at is not None:
            return self.rewarded_at
        return self.finished_at + (self.reward.duration_s if self.reward is not None else 0.0)

    def to_trajectory(self) -> Trajectory:
        """The learner's :class:`~megathunder.trajectory.Trajectory` (torch tensors)."""
        return Trajectory(
            traj_id=self.traj_id,
            group_id=self.group_id,
            tokens=torch.from_numpy(np.array(self.token_ids, dtype=np.int64)),  # numpy reads lists 3x faster
            loss_mask=torch.from_numpy(np.array(self.loss_mask, dtype=np.bool_)),
            rollout_logprobs=torch.from_numpy(np.array(self.rollout_logprobs, dtype=np.float32)),
            truncated=self.truncated,
            routed_experts=None if self.routed_experts is None else torch.from_numpy(self.routed_experts),
        )

    @classmethod
    def from_prompt(
        cls, traj_id: int, group_id: int, instance_id: str, prompt: list[int], started_at: float
    ) -> Episode:
        num_targets = len(prompt) - 1
        return cls(
            traj_id, group_id, instance_id, len(prompt), list(prompt),
            [False] * num_targets, [0.0] * num_targets, started_at=started_at,
        )  # fmt: skip

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        """Generated ids (trained, with their engine logprobs) or, with None, masked ids."""
        trained = logprobs is not None
        self.token_ids += ids
        self.loss_mask += [trained] * len(ids)
        self.rollout_logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)


@dataclass(frozen=True)
class RolloutEvent:
    """What the trainer routes to the learner, with the wall-clock time it happened."""

    kind: Literal["turn_finished", "trajectory_finished", "reward"]
    traj_id: int
    group_id: int
    time: float  # time.monotonic() when it happened
    turn_index: int | None = None  # for turn_finished
    payload: dict = field(default_factory=dict)


EventSink = Callable[[RolloutEvent], None]


def trained_reward(payload: dict) -> float | None:
    """The reward a ``reward`` event's payload gives the learner: None for a dropped group's
    failure or a non-finite reward."""
    if payload.get("drop_group"):
        return None
    r = payload.get("reward")
    return None if r is None or not math.isfinite(r) else float(r)
