"""The ``collective_rpc`` calls that load new weights into vLLM workers, for both deployments.

vLLM workers reload in place with ``reload_weights`` (checkpoint-format names, e.g. HF
``q_proj``/``k_proj``/``v_proj``; vLLM fuses them itself). Two sources are supported on every
platform:

- a **path** to a safetensors checkpoint directory the workers can read (same machine or a shared
  file system): the worker's own ``reload_weights(weights_path=...)`` (``megathunder_load_path``);
- **named tensors in memory**: serialised once to safetensors bytes and sent as one string
  argument to ``MegathunderWorkerExtension.megathunder_load_safetensors``
(``megathunder.rollout.engines.worker_extension``), which turns them
  back into tensors inside the worker. Raw tensors as RPC arguments crash vLLM's engine core, and
  the server's ``/collective_rpc`` accepts only strings, so one string payload serves both.

With ``weight_transfer: {kind: collective}`` (the default) the bytes travel instead by broadcast
over process groups the workers join once (``megathunder.weights.wire``; gloo on CPU, NCCL on GPUs)
and only the call that starts receiving goes through ``collective_rpc``: the learner's stages send
(``trainer/weight_sync.py``), or the engine's own sender for tensors in memory (``transfer.py``).
Either way the engines' ``updating`` does the pause / load / reset prefix cache / stamp version /
resume sequence around the load step.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from megathunder.rollout.types import WeightSource


@dataclass(frozen=True)
class WeightLoadCall:
    """One ``collective_rpc`` call that loads weights: method name, string args and kwargs."""

    method: str
    args: tuple[str, ...] = ()
    kwargs: dict[str, str] | None = None

    def as_json(self) -> dict[str, Any]:
        return {"method": self.method, "args": list(self.args), "kwargs": self.kwargs or {}}


Rpc = Callable[[WeightLoadCall], Awaitable[list]]
"""Runs one ``collective_rpc`` call on every worker of one engine (or of all); returns the
workers' results."""


def weight_load_call(weights: WeightSource) -> WeightLoadCall:
    """The RPC that loads ``weights`` into every worker."""
    if isinstance(weights, str | os.PathLike):
        path = Path(weights)
        if not path.is_dir() or not any(path.glob("*.safetensors")):
            raise FileNotFoundError(f"no *.safetensors checkpoint in directory {path}")
        return WeightLoadCall("megathunder_load_path", args=(str(path.resolve()),))
    return WeightLoadCall("megathunder_load_safetensors", args=(encode_tensors(weights),))


def encode_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Named tensors -> base64 of one safetensors blob (contiguous CPU copies, dtypes kept)."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
    if not tensors:
        raise ValueError("no tensors to load")
    return base64.b64encode(save(tensors)).decode("ascii")
