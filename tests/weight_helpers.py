"""Stand-ins for weight-transfer tests: vLLM workers (megathunder's worker extension itself on a
fake worker, whose ``reload_weights`` records what it was given, tensors cloned), an engine's end of
a push over them, and a learner service of one rank."""

from __future__ import annotations

import asyncio
import contextlib
import types

import torch

from megathunder.rollout.engines.worker_extension import MegathunderWorkerExtension


class FakeWorker(MegathunderWorkerExtension):
    """What the extension needs of a vLLM worker: rank, device, model dtype, ``reload_weights``,
    and a model runner (its model has no tied output layer to re-prepare)."""

    def __init__(self, rank: int = 0, dtype: torch.dtype = torch.float32) -> None:
        self.rank, self.device = rank, torch.device("cpu")
        self.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=dtype))
        self.model_runner = types.SimpleNamespace(get_model=torch.nn.Module)
        self.loaded: dict[str, torch.Tensor] = {}
        self.fail_on_receive = False

    def reload_weights(self, weights_iterator) -> None:
        for name, t in weights_iterator:
            if self.fail_on_receive:
                raise RuntimeError("worker failed to load")
            self.loaded[name] = t.clone()

    async def rpc(self, call) -> list:
        """``collective_rpc`` to this one worker: the method runs on a thread, as vLLM runs it in
        the worker's own process."""
        result = await asyncio.to_thread(getattr(self, call.method), *call.args, **(call.kwargs or {}))
        return [result]


def engine_rpc(workers: list[FakeWorker]):
    """``collective_rpc`` to every worker of one engine at once."""

    async def rpc(call):
        return [r for rs in await asyncio.gather(*(w.rpc(call) for w in workers)) for r in rs]

    return rpc


class FakeEngine:
    """An engine's end of a streamed push (``megathunder.rollout.types.WeightReceiver``) over fake
    workers: the engine's own ``WeightTransfer``, with ``events`` recording the update around it
    (pause, open, receive, resume). ``engines``: the workers of each engine."""

    def __init__(self, engines: list[list[FakeWorker]], cfg) -> None:
        self.cfg, self.workers = cfg, [w for ws in engines for w in ws]
        self.rpcs = [engine_rpc(ws) for ws in engines]
        self.rpc = engine_rpc(self.workers)
        self.transfer = None
        self.events: list[str] = []
        self.policy_version = 0

    @contextlib.asynccontextmanager
    async def updating(self, policy_version: int):
        self.events.append("pause")
        yield  # a failure here propagates: no resume (the engine stays paused)
        self.policy_version = policy_version
        self.events.append("resume")

    @property
    def transfer_open(self) -> bool:
        return self.transfer is not None and self.transfer.joined

    async def open_transfer(self, num_senders: int):
        from megathunder.rollout.engines.transfer import WeightTransfer

        self.events.append("open")
        self.transfer = await WeightTransfer.serve(self.cfg, self.rpcs, num_senders)
        return self.transfer.rdv

    async def join_transfer(self) -> None:
        await self.transfer.join()

    async def receive_weights(self) -> dict[str, float]:
        self.events.append("receive")
        return await self.transfer.receive(self.rpc)

    async def close(self) -> None:
        if self.transfer is not None:
            await self.transfer.close(self.rpc)


class ThreadService:
    """``LearnerService.call`` for one learner rank: the endpoint's method, on a thread."""

    def __init__(self, endpoint) -> None:
        self.endpoint = endpoint
        self.calls: list[str] = []

    async def call(self, method, *args):
        self.calls.append(method.__name__)
        return await asyncio.to_thread(method, self.endpoint, *args)
