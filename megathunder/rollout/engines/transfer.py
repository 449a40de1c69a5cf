"""Weights into vLLM workers over a collective, one flat bucket at a time.

Used when ``rollout.engine.weight_transfer.kind`` is ``collective``. The process holding the engine
handle (learner rank 0, where ``gather_weights`` leaves the resharded Hugging Face tensors) is
rank 0 of a process group made for this purpose only; every vLLM worker of every engine joins it
once, at engine start, through ``collective_rpc``. Per push:

1. :func:`plan_buckets` groups the tensors by dtype into buckets of at most ``weight_transfer.bucket_mb``
   (a single larger tensor gets a bucket of its own);
2. the plan -- names, shapes, dtypes, offsets -- goes to the workers in one ``collective_rpc``
   call (:meth:`MegathunderWorkerExtension.megathunder_receive_buckets`), while
3. rank 0 packs each bucket into one flat tensor and broadcasts it; each worker receives it
   into a fresh buffer, :func:`unpack` gives views of it, and vLLM's in-place reloader consumes
   them bucket by bucket. Only one bucket is in flight: the extra memory of a push is one bucket
   on the sending side, and on a worker one bucket plus what vLLM's reloader keeps of a layer
   whose tensors have not all arrived -- not a copy of the model.

The group: a ``torch.distributed.TCPStore`` that rank 0 serves on a free port, and a
``ProcessGroupGloo`` or ``ProcessGroupNCCL`` backend constructed directly on it. Such a backend
is never registered with ``torch.distributed``, so the learner's default group and vLLM's
internal groups are untouched, and its ranks are the group's own (a broadcast root is rank 0 of
this group, whatever the process's other ranks). One class serves both backends, so the NCCL path
is the gloo path with tensors on the GPU -- vLLM's ``StatelessProcessGroup`` +
``PyNcclCommunicator`` would give NCCL a second, vLLM-internal code path and offer no gloo
counterpart to test it on CPU.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore

from megathunder.config import CollectiveTransfer, EngineConfig
from megathunder.rollout.engines.rpc import Rpc, WeightLoadCall, weight_load_call
from megathunder.rollout.types import WeightSource

TIMEOUT = timedelta(minutes=10)
"""How long a rendezvous or a broadcast waits for the other ranks."""


def check_backend(backend: str) -> None:
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "rollout.engine.weight_transfer.backend: nccl needs a CUDA device and none is available "
            "(torch.cuda.is_available() is False); use gloo on CPU"
        )


# ---------------------------------------------------------------------- buckets


@dataclass(frozen=True)
class Slot:
    """One tensor's place in a bucket: ``flat[offset : offset + numel].view(shape)``."""

    name: str
    shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class Bucket:
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    numel: int
    slots: tuple[Slot, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "numel": self.numel,
                "slots": [[s.name, list(s.shape), s.offset] for s in self.slots]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Bucket:
        slots = tuple(Slot(name, tuple(shape), offset) for name, shape, offset in data["slots"])
        return cls(data["dtype"], data["numel"], slots)


def plan_buckets(named_tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[Bucket]:
    """Buckets of one dtype each and at most ``bucket_bytes`` (a larger tensor alone), in the
    tensors' order within each dtype."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named_tensors:
        by_dtype.setdefault(t.dtype, []).append((name, t))
    buckets: list[Bucket] = []
    for dtype, members in by_dtype.items():
        capacity = max(1, bucket_bytes // dtype.itemsize)  # elements
        slots: list[Slot] = []
        numel = 0
        for name, t in members:
            if slots and numel + t.numel() > capacity:
                buckets.append(Bucket(str(dtype).removeprefix("torch."), numel, tuple(slots)))
                slots, numel = [], 0
            slots.append(Slot(name, tuple(t.shape), numel))
            numel += t.numel()
        if slots:
            buckets.append(Bucket(str(dtype).removeprefix("torch."), numel, tuple(slots)))
    return buckets


def pack(bucket: Bucket, tensors: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bucket's tensors copied into one new flat tensor on ``device``."""
    flat = torch.empty(bucket.numel, dtype=bucket.torch_dtype, device=device)
    for slot in bucket.slots:
        t = tensors[slot.name].detach()
        flat[slot.offset : slot.offset + t.numel()].copy_(t.reshape(-1))
    return flat


def unpack(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Named views of a flat bucket (no copies)."""
    for slot in bucket.slots:
        yield slot.name, flat[slot.offset : slot.offset + math.prod(slot.shape)].view(slot.shape)


# ---------------------------------------------------------------------- the process group


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the transfer group meets: rank 0 serves the store at ``host:port``."""

    host: str
    port: int
    world_size: int
    backend: str

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> Rendezvous:
        return cls(**json.loads(text))


class TransferGroup:
    """This process's rank in the transfer group: broadcasts from rank 0, nothing else."""

    def __init__(self, store: torch.distributed.Store, rank: int, world_size: int, backend: str,
                 device: torch.device) -> None:
        """Blocks until every rank has joined."""
        from torch.distributed import PrefixStore

        check_backend(backend)
        store = PrefixStore("megathunder-weights", store)
        if backend == "gloo":
            from torch.distributed import ProcessGroupGloo

            self.pg = ProcessGroupGloo(store, rank, world_size, TIMEOUT)
        else:
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            self.pg = ProcessGroupNCCL(store, rank, world_size, options)
        self.store = store  # rank 0 serves it: it lives as long as the group
        self.rank, self.world_size, self.device = rank, world_size, device

    @classmethod
    def join(cls, rdv: Rendezvous, rank: int, device: torch.device) -> TransferGroup:
        """A worker's side (``rank`` > 0): connect to rank 0's store and join."""
        from torch.distributed import TCPStore

        store = TCPStore(rdv.host, rdv.port, rdv.world_size, is_master=False, timeout=TIMEOUT)
        return cls(store, rank, rdv.world_size, rdv.backend, device)

    def broadcast(self, flat: torch.Tensor) -> None:
        """In place: rank 0's ``flat`` into everyone's."""
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([flat], opts).wait()

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.pg = None


def receive(group: TransferGroup, plan: Iterable[Bucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """A worker's side of one push: each bucket broadcast into a fresh buffer, as named views."""
    for bucket in plan:
        flat = torch.empty(bucket.numel, dtype=bucket.torch_dtype, device=group.device)
        group.broadcast(flat)
        yield from unpack(bucket, flat)


# ---------------------------------------------------------------------- rank 0


class WeightSender:
    """Rank 0 of the transfer group, held by the engine in the learner's rank-0 process."""

    def __init__(self, group: TransferGroup, bucket_bytes: int) -> None:
        self.group, self.bucket_bytes = group, bucket_bytes

    @classmethod
    async def open(cls, host: str, backend: str, engines: Sequence[Rpc], bucket_bytes: int) -> WeightSender:
        """Serve the store on a free port; every worker of engine i joins as rank 1 + (workers of
        engines before i) + its rank in its engine; join as rank 0."""
        check_backend(backend)
        offsets, world_size = [], 1
        for rpc in engines:
            ranks = [int(r) for r in await rpc(WeightLoadCall("megathunder_worker_rank"))]
            if sorted(ranks) != list(range(len(ranks))):
                raise RuntimeError(f"vLLM worker ranks {ranks} are not 0..{len(ranks) - 1}: unsupported layout")
            offsets.append(world_size)
            world_size += len(ranks)
        store = TCPStore(host, 0, world_size, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
        rdv = Rendezvous(host, store.port, world_size, backend).to_json()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        joining = asyncio.gather(*(
            rpc(WeightLoadCall("megathunder_transfer_join", args=(rdv, str(offset))))
            for rpc, offset in zip(engines, offsets, strict=True)
        ))
        group = await asyncio.to_thread(TransferGroup, store, 0, world_size, backend, device)
        await joining
        return cls(group, bucket_bytes)

    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], rpc: Rpc) -> Any:
        """Plan to the workers by RPC, bytes by broadcast, concurrently; returns the RPC's result."""
        named = list(named_tensors)
        if not named:
            raise ValueError("no tensors to load")
        plan = plan_buckets(named, self.bucket_bytes)
        call = WeightLoadCall("megathunder_receive_buckets", args=(json.dumps([b.to_json() for b in plan]),))
        receiving = asyncio.ensure_future(rpc(call))
        sending = asyncio.ensure_future(asyncio.to_thread(self._send, plan, dict(named)))
        # a worker that fails stops receiving: raise its error now, not after the broadcast times out
        done, _ = await asyncio.wait((receiving, sending), return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
        await sending
        return await receiving

    def _send(self, plan: list[Bucket], tensors: Mapping[str, torch.Tensor]) -> None:
        for bucket in plan:
            self.group.broadcast(pack(bucket, tensors, self.group.device))

    async def close(self, rpc: Rpc) -> None:
        try:
            await rpc(WeightLoadCall("megathunder_transfer_close"))
        finally:
            self.group.close()


async def open_sender(cfg: EngineConfig, engines: Sequence[Rpc]) -> WeightSender | None:
    """The transfer group's rank 0 for ``engines`` (one RPC each) when ``cfg`` asks for it."""
    wt = cfg.weight_transfer
    if not isinstance(wt, CollectiveTransfer):
        return None
    return await WeightSender.open(wt.host, wt.backend, engines, int(wt.bucket_mb * 2**20))


def weight_loader(weights: WeightSource, sender: WeightSender | None) -> Callable[[Rpc], Awaitable[Any]]:
    """The load step of ``update_weights``, given the engine's RPC: in-memory tensors over the
    transfer group when the engine has one, everything else by ``collective_rpc``. Made before
    the engine pauses, so that a bad source fails with the engine still serving."""
    if sender is not None and not isinstance(weights, str | os.PathLike):
        return functools.partial(sender.push, weights)
    call = weight_load_call(weights)
    return lambda rpc: rpc(call)
