"""Moving new weights into vLLM workers, for both deployments.

vLLM workers reload in place with ``reload_weights`` (checkpoint-format names, e.g. HF
``q_proj``/``k_proj``/``v_proj``; vLLM fuses them itself). Two sources are supported on every
platform:

- a **path** to a safetensors checkpoint directory the workers can read (same machine or a shared
  file system): the worker's own ``reload_weights(weights_path=...)``;
- **named tensors in memory**: serialised once to safetensors bytes and sent as one string
  argument to :meth:`MegathunderWorkerExtension.megathunder_load_safetensors`, which turns them
  back into tensors inside the worker. Raw tensors as RPC arguments crash vLLM's engine core, and
  the server's ``/collective_rpc`` accepts only strings, so one string payload serves both.

On GPUs, weights will travel over NCCL (a later issue): that is one more method on the extension
(join a process group, receive broadcast tensors, call ``reload_weights`` with them) and one more
``WeightSource`` case; the engines' ``update_weights`` already do the pause / load / reset prefix
cache / stamp version / resume sequence around whatever the load step is.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megathunder.rollout.types import WeightSource

if TYPE_CHECKING:
    import torch

EXTENSION_CLS = "megathunder.rollout.engines.weights.MegathunderWorkerExtension"
"""Passed to vLLM as ``worker_extension_cls`` (``--worker-extension-cls`` for servers)."""


@dataclass(frozen=True)
class WeightLoadCall:
    """One ``collective_rpc`` call that loads weights: method name, string args and kwargs."""

    method: str
    args: tuple[str, ...] = ()
    kwargs: dict[str, str] | None = None

    def as_json(self) -> dict[str, Any]:
        return {"method": self.method, "args": list(self.args), "kwargs": self.kwargs or {}}


def weight_load_call(weights: WeightSource) -> WeightLoadCall:
    """The RPC that loads ``weights`` into every worker."""
    if isinstance(weights, str | os.PathLike):
        path = Path(weights)
        if not path.is_dir() or not any(path.glob("*.safetensors")):
            raise FileNotFoundError(f"no *.safetensors checkpoint in directory {path}")
        return WeightLoadCall("reload_weights", kwargs={"weights_path": str(path.resolve())})
    return WeightLoadCall("megathunder_load_safetensors", args=(encode_tensors(weights),))


def encode_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Named tensors -> base64 of one safetensors blob (contiguous CPU copies, dtypes kept)."""
    from safetensors.torch import save

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
    if not tensors:
        raise ValueError("no tensors to load")
    return base64.b64encode(save(tensors)).decode("ascii")


class MegathunderWorkerExtension:
    """Methods vLLM mixes into each of its workers (``worker_extension_cls``).

    ``self`` is the vLLM worker; ``self.reload_weights`` is its in-place reloader.
    """

    def megathunder_load_safetensors(self, payload_b64: str) -> int:
        """Load the base64 safetensors blob made by :func:`encode_tensors`; returns #tensors."""
        from safetensors.torch import load

        tensors = load(base64.b64decode(payload_b64))
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)
