"""A stand-in for vLLM workers in weight-transfer tests: megathunder's worker extension itself on
a fake worker, whose ``reload_weights`` records what it was given (tensors cloned)."""

from __future__ import annotations

import asyncio
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
