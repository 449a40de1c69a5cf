"""``LearnerClient``: the controller's typed view of the learner ranks.

Every method is one ``LearnerEndpoint`` call through the ``LearnerService`` (run on every learner
rank, in submission order): ``await learner.close()`` rather than
``service.call(LearnerEndpoint.close)``. Event calls (``finished``, ``reward``, ``turn``,
``add_group``) are queued and go to the learner in bursts (``LearnerService.submit_event``): a burst
of sequences finishing in one engine step wakes the learner once, while the engine still generates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megathunder.learner.batches import BatchOutcome
from megathunder.learner.endpoint import LearnerEndpoint
from megathunder.learner.learner import StepResult
from megathunder.learner.service import LearnerService
from megathunder.trajectory import BatchPlan, Trajectory


class LearnerClient:
    """Rank 0's calls on the learner (module docstring)."""

    def __init__(self, service: LearnerService[LearnerEndpoint]) -> None:
        self.service = service

    @property
    def world_size(self) -> int:
        return self.service.world_size

    # ------------------------------------------------------------------ a batch

    def begin(self, plan: BatchPlan, streamed: bool) -> None:
        """A new batch (queued; the events after it reach this batch)."""
        self.service.submit(LearnerEndpoint.begin, plan, streamed)

    def finished(self, traj: Trajectory) -> None:
        self._event(LearnerEndpoint.finished, traj)

    def reward(self, traj_id: int, reward: float | None) -> None:
        self._event(LearnerEndpoint.reward, traj_id, reward)

    def turn(self, traj_id: int, tokens: list[int], start: int, end: int, logprobs: list[float] | None) -> None:
        self._event(LearnerEndpoint.turn, traj_id, tokens, start, end, logprobs)

    def add_group(self, group_id: int, traj_ids: list[int]) -> None:
        self._event(LearnerEndpoint.add_group, group_id, traj_ids)

    def _event(self, method: Callable[..., None], *args: Any) -> None:
        """Queued with the other events of this turn of the event loop, sent as one message at its
        end (or now, outside a running loop: the batch-synchronous path sends them before ``close``)."""
        if self.service.submit_event(method, *args):
            try:
                asyncio.get_running_loop().call_soon(self.service.flush_events)
            except RuntimeError:  # no loop: the next call sends them first
                pass

    def flush(self) -> None:
        """Send the queued events now."""
        self.service.flush_events()

    async def close(self) -> BatchOutcome:
        """The batch's gradient, divided by Z, in DDP's buffers (the queued events first)."""
        return await self.service.call(LearnerEndpoint.close)

    async def step(self) -> StepResult:
        return await self.service.call(LearnerEndpoint.step)

    # ------------------------------------------------------------------ weights, checks, files

    async def join_weight_transfer(self, rendezvous_json: str) -> None:
        await self.service.call(LearnerEndpoint.join_weight_transfer, rendezvous_json)

    async def send_weights(self) -> dict[str, float]:
        return await self.service.call(LearnerEndpoint.send_weights)

    async def gather_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        return await self.service.call(LearnerEndpoint.gather_weights)

    async def score(self, tokens: list[int], prompt_len: int, routed_experts: torch.Tensor | None = None,
                    temperature: float | None = None) -> torch.Tensor:
        """The learner's logprobs of ``tokens[prompt_len:]`` (``LearnerEndpoint.score``)."""
        return await self.service.call(LearnerEndpoint.score, tokens, prompt_len, routed_experts, temperature)

    async def checkpoint(self) -> str | None:
        """A checkpoint of the learner's state; None before its first optimizer step (nothing to save)."""
        return await self.service.call(LearnerEndpoint.checkpoint)

    async def export(self, path: Path) -> None:
        await self.service.call(LearnerEndpoint.export, str(path))
