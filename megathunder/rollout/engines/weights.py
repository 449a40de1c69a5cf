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

With ``weight_transfer: collective`` the bytes travel instead by broadcast over a process group
the workers join once (``transfer.py``; gloo on CPU, NCCL on GPUs) and only the bucket plan goes
through ``collective_rpc``. Either way the engines' ``update_weights`` do the pause / load /
reset prefix cache / stamp version / resume sequence around the load step.
"""

from __future__ import annotations

import base64
import functools
import json
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megathunder.rollout.types import WeightSource

if TYPE_CHECKING:
    import torch

    from megathunder.rollout.engines.transfer import Rpc, WeightSender

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


def weight_loader(weights: WeightSource, sender: WeightSender | None) -> Callable[[Rpc], Awaitable[Any]]:
    """The load step of ``update_weights``, given the engine's RPC: in-memory tensors over the
    transfer group when the engine has one, everything else by ``collective_rpc``. Made before
    the engine pauses, so that a bad source fails with the engine still serving."""
    if sender is not None and not isinstance(weights, str | os.PathLike):
        return functools.partial(sender.push, weights)
    call = weight_load_call(weights)
    return lambda rpc: rpc(call)


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

    def megathunder_worker_rank(self) -> int:
        """This worker's rank among its engine's workers (the transfer group counts them)."""
        return self.rank  # type: ignore[attr-defined]

    def megathunder_transfer_join(self, rendezvous_json: str, rank_offset: str) -> int:
        """Join the weight-transfer group as rank ``rank_offset`` + this worker's rank; returns it."""
        from megathunder.rollout.engines.transfer import Rendezvous, TransferGroup

        rank = int(rank_offset) + self.rank  # type: ignore[attr-defined]
        rdv = Rendezvous.from_json(rendezvous_json)
        self.megathunder_transfer = TransferGroup.join(rdv, rank, self.device)  # type: ignore[attr-defined]
        return rank

    def megathunder_receive_buckets(self, plan_json: str) -> int:
        """Receive the broadcast buckets ``plan_json`` describes and reload from them, bucket by
        bucket; returns #tensors. One ``reload_weights`` (the model's ``load_weights`` between
        vLLM's layerwise-reload set-up and finish) consumes the buckets as they arrive, rather than
        one call per bucket: vLLM runs a layer's post-load processing once all of its tensors have
        been loaded, and a layer's tensors may span buckets."""
        from megathunder.rollout.engines.transfer import Bucket, receive

        group = getattr(self, "megathunder_transfer", None)
        if group is None:
            raise RuntimeError("this worker is in no weight-transfer group (never joined, or closed)")
        plan = [Bucket.from_json(b) for b in json.loads(plan_json)]
        tensors = receive(group, plan)
        self.reload_weights(weights_iterator=tensors)  # type: ignore[attr-defined]
        for _ in tensors:  # buckets the loader left unread: rank 0 broadcasts every one
            pass
        return sum(len(b.slots) for b in plan)

    def megathunder_transfer_close(self) -> None:
        group = getattr(self, "megathunder_transfer", None)
        if group is not None:
            group.close()
            self.megathunder_transfer = None
