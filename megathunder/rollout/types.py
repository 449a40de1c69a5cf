"""The interfaces between the rollout side's parts: sampling parameters, completions, the engine.

Token ids in, token ids and per-token logprobs out: the agent loop never re-tokenises text it has
already tokenised, so there is no drift between turns.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, Union

if TYPE_CHECKING:
    import numpy as np
    import torch

    from megathunder.weights.wire import Rendezvous


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k truncation
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks: generate exactly max_new_tokens
    priority: int = 0  # lower is served first; non-zero needs rollout.engine.scheduling != fifo
    prompt_logprobs_from: int | None = None  # also score the prompt from this position (the probe):
    # logprobs of softmax(logits) (temperature 1) in ``Completion.prompt_logprobs``, computed in the
    # prefill without reading the prefix cache


FinishReason = Literal["stop", "length", "abort"]
"""Why a completion ended: "stop": EOS or a stop token (returned last); "length": max_new_tokens
or the model length; "abort": the request was aborted."""


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # one per generated token, from the engine that sampled it (by default of
    # the distribution actually sampled, after temperature/top-p/top-k: EngineConfig.logprobs_mode)
    finish_reason: FinishReason  # "stop": EOS or a stop token (returned last)
    policy_version: int  # weights version that produced every token (-1: aborted before any token)
    prompt_logprobs: list[float] | None = None  # SamplingParams.prompt_logprobs_from: the prompt's
    # tokens from there on, each given the tokens before it


WeightSource = Union[str, os.PathLike, Iterable[tuple[str, "torch.Tensor"]]]
"""A safetensors checkpoint directory the engine can read, or (checkpoint_name, tensor) pairs. The
learner's weights reach the engine another way: its stages stream them (``WeightReceiver``)."""


class RolloutEngine(Protocol):
    """One inference engine (in-process vLLM, or a pool of vLLM servers behind a load balancer).

    Built by ``megathunder.rollout.engines.start_engine(cfg, model_path)``.
    """

    @property
    def policy_version(self) -> int:
        """Version of the weights new requests are sampled from."""
        ...

    async def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, *, session_id: Hashable | None = None
    ) -> Completion:
        """Sample one completion. ``session_id`` (e.g. the trajectory id) routes an episode's turns
        to the server that holds its prefix in cache; one in-process engine ignores it."""
        ...

    async def update_weights(self, weights: WeightSource, policy_version: int) -> None:
        """Load new weights and reset the prefix cache; later completions carry the new version.

        Requests already running finish on the old weights; requests arriving meanwhile wait.
        """
        ...

    async def reset_prefix_cache(self) -> None: ...

    async def close(self) -> None: ...


Revive = Callable[[RolloutEngine], Awaitable[None]]
"""Given to an engine at its start: awaited once a dead engine core has been started again in
place, before the requests it cut off go again -- the owner loads its current weights into the
engine it is given and checks them (the trainer: ``WeightSync.push``, then the probe)."""


class WeightReceiver(Protocol):
    """An engine's end of a weight push that the learner's pipeline stages stream
    (``weight_transfer.kind=collective``, started with ``senders="learner"``). The controller drives
    both ends (``megathunder.trainer.weight_sync``)::

        rdv = await engine.open_transfer(num_stages)       # once, and whenever not transfer_open
        both(engine.join_transfer(), <each stage joins rdv>)
        async with engine.updating(version):               # drain, pause ... reset, stamp, resume
            both(engine.receive_weights(), <each stage sends>)
    """

    def updating(self, policy_version: int) -> AbstractAsyncContextManager[None]:
        """Drain the requests in flight and pause; the block loads the weights; on its clean exit
        reset the prefix cache, stamp ``policy_version`` and resume. If the block fails the engine
        stays paused: better no tokens than tokens from half-loaded weights."""
        ...

    @property
    def transfer_open(self) -> bool:
        """Are the transfer groups open with every worker the engine samples from? (Not after a
        server was lost or the engine core restarted: ``open_transfer`` again.)"""
        ...

    async def open_transfer(self, num_senders: int) -> Rendezvous:
        """Serve the store of ``num_senders`` new transfer groups; where and how to join them."""
        ...

    async def join_transfer(self) -> None:
        """Every worker joins the groups; returns once the senders have too."""
        ...

    async def receive_weights(self) -> dict[str, float]:
        """Inside ``updating``: every worker receives the senders' frames and reloads from them;
        the slowest worker's seconds (``total_s``, and ``wait_s`` blocked on the wire)."""
        ...


class RoutingSource(Protocol):
    """An engine that records its MoE routing (``EngineConfig.record_routing``)."""

    async def routed_experts(self, token_ids: Sequence[int], session_id: Hashable | None = None) -> np.ndarray:
        """[len - 1, layers, top_k] expert ids of each input position of ``token_ids`` (servers:
        read from the server of ``session_id``, the one that served the episode's last turn)."""
        ...
