"""The interfaces between the rollout side's parts, and the events it emits.

Token ids in, token ids and per-token logprobs out: the agent loop never re-tokenises text it has
already tokenised, so there is no drift between turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # one per generated token, from the engine that sampled it
    finish_reason: Literal["stop", "length", "abort"]
    policy_version: int  # weights version that produced every token of this completion


class RolloutEngine(Protocol):
    """One inference engine (in-process vLLM, or a pool of vLLM servers behind a load balancer)."""

    async def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> Completion: ...

    async def update_weights(self, named_tensors_path_or_iter, policy_version: int) -> None:
        """Load new weights (and reset the prefix cache); later completions carry the new version."""
        ...

    async def reset_prefix_cache(self) -> None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class RolloutEvent:
    """What the trainer routes to the learner, with the wall-clock time it happened."""

    kind: Literal["turn_finished", "trajectory_finished", "reward"]
    traj_id: int
    group_id: int
    time: float  # time.monotonic() when it happened
    turn_index: int | None = None  # for turn_finished
    payload: dict = field(default_factory=dict)
