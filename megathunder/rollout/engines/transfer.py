"""An engine's end of the weight push (``weight_transfer.kind=collective``): its transfer groups.

The wire -- frames, groups, the rendezvous, both ends at once -- is ``megathunder.weights.wire``.
Here the engine's part of it:

- **Serve** (:meth:`WeightTransfer.serve`): ask every engine's workers their rank and model dtype,
  serve the groups' ``TCPStore`` in this process (``weight_transfer.host:port``; port 0: a free
  one), and describe the groups in a :class:`~megathunder.weights.wire.Rendezvous`: one group per
  sender, every worker of engine i in each as rank 1 + (workers of engines before i) + its rank in
  its engine, senders cast to the workers' dtype.
- **Join** (:meth:`WeightTransfer.join`): every worker joins every group (one RPC per engine); it
  returns once the senders have joined too. The learner's stage senders join from the learner's
  ranks (``megathunder.learner.push``), concurrently (``trainer/weight_sync.py``); an engine that
  sends itself (:meth:`WeightTransfer.open_local`: tests, benchmarks, eval) joins as the one group's
  rank 0 on a thread of this process.
- **Receive** (:meth:`WeightTransfer.receive`): one RPC in which every worker reads each sender's
  frames in turn and reloads from them, while the senders broadcast.

A group's broadcasts wait for every rank of it, so a group that lost a worker (a server lost, an
engine core restarted) is never used again: the engine serves new groups, with a new store on an
ephemeral port, and the senders join them again (their next push is dense).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import torch
from torch.distributed import TCPStore

from megathunder.config import CollectiveTransfer
from megathunder.rollout.engines.rpc import Rpc, WeightLoadCall, weight_load_call
from megathunder.rollout.types import WeightSource
from megathunder.weights.wire import TIMEOUT, FrameWriter, PushStats, Rendezvous, TransferGroup, both, resolve_backend


class WeightTransfer:
    """An engine's transfer groups: the store (served here), the rendezvous, the engines' RPCs
    (``engines[i]`` reaches every worker of engine i) and -- for an engine that sends itself --
    this process's sender (rank 0 of the one group)."""

    def __init__(self, store: TCPStore, rdv: Rendezvous, engines: Sequence[Rpc], offsets: Sequence[int]) -> None:
        self.store, self.rdv, self.engines, self.offsets = store, rdv, list(engines), list(offsets)
        self.local: TransferGroup | None = None
        self.joined = False  # every worker is in every group (``join`` returned)
        self.last_received: dict[str, float] = {}
        """The last push, slowest worker: seconds in all (``total_s``) and blocked on the wire (``wait_s``)."""

    @classmethod
    async def serve(cls, cfg: CollectiveTransfer, engines: Sequence[Rpc], num_senders: int) -> WeightTransfer:
        """The store, served here, and the rendezvous of ``num_senders`` groups; nobody has joined."""
        backend = resolve_backend(cfg.backend)
        offsets, world_size, dtypes = [], 1, set()
        for rpc in engines:
            infos = [json.loads(r) for r in await rpc(WeightLoadCall("megathunder_worker_info"))]
            ranks = sorted(i["rank"] for i in infos)
            if ranks != list(range(len(ranks))):
                raise RuntimeError(f"vLLM worker ranks {ranks} are not 0..{len(ranks) - 1}: unsupported layout")
            dtypes |= {i["dtype"] for i in infos}
            offsets.append(world_size)
            world_size += len(ranks)
        if len(dtypes) > 1:
            raise RuntimeError(f"the engines' workers run different dtypes {sorted(dtypes)}: one push cannot serve them")
        store = TCPStore(cfg.host, cfg.port, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
        rdv = Rendezvous(cfg.host, store.port, world_size, backend, num_senders,
                         dtypes.pop() if dtypes else "float32", int(cfg.bucket_mb * 2**20), cfg.sparse_threshold)
        return cls(store, rdv, engines, offsets)

    async def join(self) -> None:
        """Every worker of every engine joins every group; returns once the senders have joined too."""
        await asyncio.gather(*(
            rpc(WeightLoadCall("megathunder_transfer_join", args=(self.rdv.to_json(), str(offset))))
            for rpc, offset in zip(self.engines, self.offsets, strict=True)
        ))
        self.joined = True

    @classmethod
    async def open_local(cls, cfg: CollectiveTransfer, engines: Sequence[Rpc]) -> WeightTransfer:
        """Groups whose one sender is this process (tensors in memory: tests, benchmarks, eval)."""
        transfer = await cls.serve(cfg, engines, 1)
        rdv = transfer.rdv
        device = torch.device("cuda", torch.cuda.current_device()) if rdv.backend == "nccl" else torch.device("cpu")
        _, transfer.local = await both(transfer.join(), asyncio.to_thread(
            TransferGroup, transfer.store, rdv.prefix(0), 0, rdv.world_size, rdv.backend, device))
        return transfer

    async def receive(self, rpc: Rpc) -> dict[str, float]:
        """Every worker receives one push (``rpc``: one call to every worker) while the senders
        broadcast it -- run with the senders by ``both``; the slowest worker's seconds."""
        self.last_received = {}
        received = [json.loads(r) for r in await rpc(WeightLoadCall("megathunder_receive_stream"))]
        self.last_received = {key: max(r[key] for r in received) for key in ("total_s", "wait_s")} if received else {}
        return self.last_received

    async def push_local(self, named_tensors: Iterable[tuple[str, torch.Tensor]], rpc: Rpc) -> PushStats:
        """Tensors held by this process (no learner senders), bucket by bucket."""
        if self.local is None:
            raise RuntimeError("this engine's weights come from the learner's stage senders (WeightSync); "
                               "tensors in memory go by rpc (weight_transfer.kind=rpc) or a checkpoint path")
        group = self.local
        named = list(named_tensors)
        if not named:
            raise ValueError("no tensors to load")

        def send() -> PushStats:
            writer = FrameWriter(group, self.rdv.bucket_bytes)
            for name, t in named:
                writer.add(name, tuple(t.shape), t.detach())
            return writer.finish()

        _, stats = await both(self.receive(rpc), asyncio.to_thread(send))
        return stats

    async def close(self, rpc: Rpc) -> None:
        try:
            await rpc(WeightLoadCall("megathunder_transfer_close"))
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Close only what this process holds (the engine's workers are gone or cannot be asked)."""
        if self.local is not None:
            self.local.close()


def weight_loader(weights: WeightSource, transfer: WeightTransfer | None) -> Callable[[Rpc], Awaitable[Any]]:
    """The load step of ``update_weights``, given the engine's RPC: tensors in memory over the
    engine's own transfer group, a checkpoint path (or anything without groups) by
    ``collective_rpc``. Made before the engine pauses, so that a bad source fails with the engine
    still serving. (The learner's weights come another way: ``trainer/weight_sync.py``.)"""
    if transfer is not None and not isinstance(weights, str | os.PathLike):
        return lambda rpc: transfer.push_local(weights, rpc)
    call = weight_load_call(weights)
    return lambda rpc: rpc(call)
