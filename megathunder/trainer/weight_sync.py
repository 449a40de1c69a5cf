"""The weight push, both ends in one place: the controller pauses vLLM, posts its workers' receives,
starts the learner's stage senders, and resumes vLLM.

    connect()      start-up, and whenever the engine's groups lost a worker (a server lost, an
                   engine core restarted):
      rdv = engine.open_transfer(num_stages)          the engine serves a store for one group per stage
      both(engine.join_transfer(),                    every vLLM worker joins every group, while
           learner: join_weight_transfer(rdv))        each stage's sender joins its own (push.py)

    push(version)  after every optimizer step (and into a restarted engine, its revival):
      async with engine.updating(version):            drain, pause; on a clean exit reset the
                                                      prefix cache, stamp version, resume
          connect() if not engine.transfer_open
          both(engine.receive_weights(),              every vLLM worker posts its receive, while
               learner: send_weights())               every stage broadcasts its buckets (push.py)

Both ends run at once (``megathunder.weights.wire.both``): a broadcast waits for every rank of its
group, and the exchange fails as soon as either end does -- a worker's error first, since it says
why a sender's broadcast failed. A push that fails leaves the engine paused: better no tokens than
tokens from half-loaded weights. The frames, groups and their bounds: ``megathunder.weights.wire``.

With ``weight_transfer.kind=rpc`` there are no groups: rank 0 gathers the model
(``LearnerEndpoint.gather_weights``, before the engine pauses) and the engine loads it by RPC
(``update_weights``).
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch

from megathunder.config import CollectiveTransfer, WeightTransfer
from megathunder.learner.endpoint import LearnerEndpoint
from megathunder.learner.service import LearnerService
from megathunder.rollout.types import RolloutEngine, WeightReceiver
from megathunder.weights.wire import both


class WeightEndpoint(Protocol):
    """The learner calls of a push, run on every learner rank (``LearnerEndpoint``'s)."""

    def join_weight_transfer(self, rendezvous_json: str) -> None: ...

    def send_weights(self) -> dict[str, float]: ...

    def gather_weights(self) -> list[tuple[str, torch.Tensor]] | None: ...


class WeightSync:
    """The learner's weights into ``engine`` (module docstring). ``service`` runs the calls of
    ``endpoint`` (``LearnerEndpoint``; a benchmark's own) on every learner rank; ``num_stages``:
    the learner's pipeline stages, one sender each."""

    def __init__(self, engine: RolloutEngine, service: LearnerService[Any], cfg: WeightTransfer, num_stages: int,
                 endpoint: type[WeightEndpoint] = LearnerEndpoint) -> None:
        self.engine, self.service, self.cfg, self.num_stages = engine, service, cfg, num_stages
        self.endpoint = endpoint

    @property
    def streamed(self) -> bool:
        """The stages stream their buckets into the engine's groups (``kind=collective``)."""
        return isinstance(self.cfg, CollectiveTransfer)

    def _receiver(self) -> WeightReceiver:
        return cast(WeightReceiver, self.engine)  # started with senders="learner"

    async def connect(self) -> None:
        """The learner's stage senders and the engine's workers join new transfer groups."""
        if not self.streamed:
            return
        engine = self._receiver()
        rdv = await engine.open_transfer(self.num_stages)
        await both(engine.join_transfer(), self.service.call(self.endpoint.join_weight_transfer, rdv.to_json()))

    async def push(self, version: int) -> dict[str, float]:
        """The learner's weights into the engine, which then samples as ``version``; the push's
        figures (``payload_bytes``, ``changed_fraction``, ...: ``learner/push.py``; none by rpc)."""
        if not self.streamed:
            gathered = await self.service.call(self.endpoint.gather_weights)
            assert gathered is not None  # gathered on global rank 0, the controller
            await self.engine.update_weights(gathered, version)
            return {}
        engine = self._receiver()
        async with engine.updating(version):
            if not engine.transfer_open:  # a server lost, an engine core restarted: the senders join anew
                await self.connect()
            _, stats = await both(engine.receive_weights(), self.service.call(self.endpoint.send_weights))
        return stats
