"""Weights into vLLM workers over collectives, bucket by bucket, one sender per pipeline stage.

Used when ``rollout.engine.weight_transfer.kind`` is ``collective`` (the default). The layout:

- **One process group per sender**: group ``s`` has the sender as its rank 0 and every vLLM worker
  of every engine as ranks 1..W. In training the senders are the learner's pipeline stages -- the
  (TP rank 0, DP rank 0) rank of stage ``s`` sends stage ``s``'s tensors (``megathunder.learner.push``)
  -- so the bytes of a push leave each stage directly; no rank collects the model. An engine used
  on its own (tests, benchmarks, ``update_weights`` with tensors in memory) has one group whose
  sender is the process holding the engine.
- **Frames**: a sender's push is a sequence of frames, each three broadcasts from rank 0 of its
  group -- the byte length of a JSON header (``int64[1]``; 0 ends the sender's push), the header
  (``uint8``: kind, dtype, and each tensor's name, HF shape and offset in the payload), the payload:
  one flat ``dtype`` tensor for a dense bucket, or flat indices then flat values for a *sparse*
  bucket (patches: only the elements that changed since the last push, ``sparse_threshold``). A
  frame describes itself, so no plan travels by RPC and a sender decides bucket by bucket, as the
  tensors arrive, where a bucket ends and whether a tensor goes dense or sparse.
- **Workers** receive group 0's frames until its end marker, then group 1's, and so on, in one
  ``collective_rpc`` (:meth:`MegathunderWorkerExtension.megathunder_receive_stream`) that runs
  while the senders broadcast; the senders go in turn because every worker reads the groups in
  order. Dense tensors feed vLLM's in-place reloader as they arrive; with sparse patches enabled
  each worker keeps a copy of the weights in checkpoint layout (vLLM's CPU linear layers keep only
  their prepacked oneDNN form, so there is nothing to patch in place), patches it, and reloads from
  it.

Pipelined: a sender packs bucket k + 1 while bucket k is on the wire, and a worker receives frame
k + 1 (on a thread) while vLLM loads frame k, so a push takes about the slowest of the three
rather than their sum. Memory, per push: a sender holds two buckets (the one it packs, the one on
the wire) plus the parameter being converted; a worker two frames plus what vLLM's reloader keeps
of a layer whose tensors have not all arrived -- never a copy of the model (with sparse patches a
worker also keeps its copy).

The groups: a ``torch.distributed.TCPStore`` served by the engine's process on
``weight_transfer.host:port`` (port 0: a free one) and one ``ProcessGroupGloo`` or
``ProcessGroupNCCL`` per sender constructed directly on a prefix of it. Such backends are never
registered with ``torch.distributed``, so the learner's groups and vLLM's are untouched and each
group's ranks are its own. vLLM 0.32's weight-transfer engines (``vllm.distributed.weight_transfer``:
``nccl_engine``, ``sparse_nccl_engine``, ``m2n_engine``, ``packed_tensor``) broadcast over
vLLM's ``PyNcclCommunicator`` and CUDA streams only, so they cannot run (or be tested) on CPU, and
they have one trainer sender; the frames above are the same idea over a backend chosen per machine.
Sparse patches are vLLM's own format (flat indices into the checkpoint tensor, values).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import queue
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore

from megathunder.config import CollectiveTransfer, EngineConfig
from megathunder.rollout.engines.rpc import Rpc, WeightLoadCall, weight_load_call
from megathunder.rollout.types import StreamedWeights, WeightSource

TIMEOUT = timedelta(minutes=10)
"""How long a rendezvous or a broadcast waits for the other ranks."""
RECEIVER_ERROR_GRACE_S = 10.0
"""When a sender fails, how long to wait for the workers' RPC to report their own error."""


def check_backend(backend: str) -> None:
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "rollout.engine.weight_transfer.backend: nccl needs a CUDA device and none is available "
            "(torch.cuda.is_available() is False); use gloo on CPU"
        )


def resolve_backend(backend: str) -> str:
    """``auto``: NCCL where CUDA is available, gloo elsewhere."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    check_backend(backend)
    return backend


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------- frames


@dataclass(frozen=True)
class Slot:
    """One tensor in a frame: dense, ``payload[offset : offset + prod(shape)].view(shape)``; sparse,
    ``count`` patch entries at ``indices[offset : offset + count]`` / ``values[...]``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    count: int | None = None  # sparse: number of changed elements


@dataclass(frozen=True)
class Frame:
    kind: str  # "dense" | "sparse"
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    numel: int  # elements in the payload (sparse: in each of indices and values)
    slots: tuple[Slot, ...]
    index_dtype: str = "int32"  # flat indices into the tensor (HF tensors have < 2**31 elements)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "dtype": self.dtype, "numel": self.numel, "index_dtype": self.index_dtype,
                "slots": [[s.name, list(s.shape), s.offset, s.count] for s in self.slots]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Frame:
        slots = tuple(Slot(name, tuple(shape), offset, count) for name, shape, offset, count in data["slots"])
        return cls(data["kind"], data["dtype"], data["numel"], slots, data.get("index_dtype", "int32"))

    @property
    def nbytes(self) -> int:
        if self.kind == "dense":
            return self.numel * self.torch_dtype.itemsize
        return self.numel * (self.torch_dtype.itemsize + getattr(torch, self.index_dtype).itemsize)


class TransferGroup:
    """This process's rank in one sender's group: broadcasts from rank 0, nothing else."""

    def __init__(self, store: torch.distributed.Store, prefix: str, rank: int, world_size: int, backend: str,
                 device: torch.device) -> None:
        """Blocks until every rank has joined."""
        from torch.distributed import PrefixStore

        check_backend(backend)
        store = PrefixStore(prefix, store)
        if backend == "gloo":
            from torch.distributed import ProcessGroupGloo

            self.pg = ProcessGroupGloo(store, rank, world_size, TIMEOUT)
        else:
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            self.pg = ProcessGroupNCCL(store, rank, world_size, options)
        self.store = store  # the engine's process serves it: it lives as long as the group
        self.rank, self.world_size, self.device = rank, world_size, device

    def broadcast(self, flat: torch.Tensor) -> None:
        """In place: rank 0's ``flat`` into everyone's."""
        self.broadcast_async(flat).wait()

    def broadcast_async(self, flat: torch.Tensor) -> torch.distributed.Work:
        """``broadcast``, started: ``flat`` must stay untouched until the returned work's ``wait()``."""
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = 0
        return self.pg.broadcast([flat], opts)

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.pg = None


@dataclass
class PushStats:
    """What one sender's push put on the wire."""

    num_frames: int = 0
    num_tensors: int = 0
    num_sparse_tensors: int = 0
    payload_bytes: int = 0  # frame payloads (dense values, sparse indices + values)
    dense_bytes: int = 0  # what the same tensors would have been as dense buckets
    changed_elements: int = 0  # sparse tensors: patch entries; dense ones count whole
    num_elements: int = 0

    def add(self, other: PushStats) -> PushStats:
        return PushStats(*(a + b for a, b in zip(self.__dict__.values(), other.__dict__.values(), strict=True)))


class FrameWriter:
    """Rank 0 of one group: packs tensors into frames of at most ``bucket_bytes`` and broadcasts
    each when full. A frame's payload goes out asynchronously while the next bucket is packed: two
    dense buffers of ``bucket_bytes`` per push, used in turn (the one on the wire is never written:
    a frame's header waits for the frame before it, whose payload is then waited for before its
    buffer is reused). A tensor larger than a bucket goes as a frame of its own (its own storage,
    not copied when contiguous). Call :meth:`finish` to end the push (it flushes, waits for the
    last payload, then sends the end marker)."""

    def __init__(self, group: TransferGroup, bucket_bytes: int) -> None:
        self.group, self.bucket_bytes = group, bucket_bytes
        self.stats = PushStats()
        self._buffer: torch.Tensor | None = None  # the bucket being packed
        self._spare: torch.Tensor | None = None  # the last one sent (maybe still on the wire)
        self._in_flight: list[tuple[torch.distributed.Work, torch.Tensor]] = []  # the last frame's payload
        self._slots: list[Slot] = []
        self._used = 0
        self._sparse: list[tuple[Slot, torch.Tensor, torch.Tensor]] = []
        self._sparse_used = 0

    # -- dense
    def add(self, name: str, shape: Sequence[int], view: torch.Tensor, changed: int | None = None) -> None:
        """``view``: the tensor, or a view whose row-major elements are the tensor's (``hf.HFView``);
        ``changed``: how many of its elements changed since the last push, when known (statistics)."""
        numel = math.prod(shape)
        if view.numel() != numel:
            raise ValueError(f"{name}: {view.numel()} elements for shape {tuple(shape)}")
        self._flush_sparse()
        capacity = max(1, self.bucket_bytes // view.dtype.itemsize)
        if self._buffer is not None and (self._buffer.dtype != view.dtype or self._used + numel > capacity):
            self._flush_dense()
        self._count(numel, numel if changed is None else changed, view.dtype)
        if numel > capacity:  # alone, from its own storage
            flat = view.reshape(-1) if view.is_contiguous() else view.contiguous().reshape(-1)
            flat = flat.to(self.group.device)
            self._send(Frame("dense", dtype_name(view.dtype), numel, (Slot(name, tuple(shape), 0),)), [flat])
            return
        if self._buffer is None or self._buffer.dtype != view.dtype:
            self._buffer = torch.empty(capacity, dtype=view.dtype, device=self.group.device)
        self._buffer[self._used : self._used + numel].view(view.shape).copy_(view)
        self._slots.append(Slot(name, tuple(shape), self._used))
        self._used += numel

    def skip(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> None:
        """A tensor unchanged since the last push: nothing on the wire (statistics only)."""
        self._count(math.prod(shape), 0, dtype)

    def _count(self, numel: int, changed: int, dtype: torch.dtype, sparse: bool = False) -> None:
        self.stats.num_tensors += 1
        self.stats.num_sparse_tensors += int(sparse)
        self.stats.num_elements += numel
        self.stats.changed_elements += changed
        self.stats.dense_bytes += numel * dtype.itemsize

    def _flush_dense(self) -> None:
        if not self._slots:
            return
        assert self._buffer is not None
        frame = Frame("dense", dtype_name(self._buffer.dtype), self._used, tuple(self._slots))
        self._send(frame, [self._buffer[: self._used]])
        self._slots, self._used = [], 0
        # pack the next bucket while this one is on the wire: into the other buffer, whose frame
        # ``_send`` has just waited for (after the first frame: a second buffer, allocated by ``add``)
        self._buffer, self._spare = self._spare, self._buffer

    # -- sparse
    def add_sparse(self, name: str, shape: Sequence[int], indices: torch.Tensor, values: torch.Tensor) -> None:
        """A patch: ``tensor.view(-1)[indices] = values`` (flat indices, values in the tensor's dtype)."""
        self._flush_dense()
        if math.prod(shape) >= 2**31:
            raise ValueError(f"{name}: {math.prod(shape)} elements do not fit int32 patch indices")
        nbytes = indices.numel() * (torch.int32.itemsize + values.dtype.itemsize)
        if self._sparse and (values.dtype != self._sparse[0][2].dtype
                             or self._sparse_used + nbytes > self.bucket_bytes):
            self._flush_sparse()
        offset = sum(int(i.numel()) for _, i, _ in self._sparse)
        self._sparse.append((Slot(name, tuple(shape), offset, int(indices.numel())), indices, values))
        self._sparse_used += nbytes
        self._count(math.prod(shape), int(indices.numel()), values.dtype, sparse=True)
        if self._sparse_used > self.bucket_bytes:
            self._flush_sparse()

    def _flush_sparse(self) -> None:
        if not self._sparse:
            return
        dtype = self._sparse[0][2].dtype
        indices = torch.cat([i.reshape(-1).to(torch.int32) for _, i, _ in self._sparse]).to(self.group.device)
        values = torch.cat([v.reshape(-1) for _, _, v in self._sparse]).to(self.group.device)
        frame = Frame("sparse", dtype_name(dtype), int(values.numel()), tuple(s for s, _, _ in self._sparse))
        self._sparse, self._sparse_used = [], 0
        self._send(frame, [indices, values])

    # -- wire
    def _send(self, frame: Frame, payload: list[torch.Tensor]) -> None:
        """The header now (it completes once the workers have taken the frame before), then the
        payload started; the previous frame's payload is waited for first, so one is in flight."""
        header = torch.frombuffer(bytearray(json.dumps(frame.to_json()).encode()), dtype=torch.uint8)
        self.group.broadcast(torch.tensor([header.numel()], dtype=torch.int64, device=self.group.device))
        self.group.broadcast(header.to(self.group.device))
        self._wait()
        self._in_flight = [(self.group.broadcast_async(flat), flat) for flat in payload]
        self.stats.num_frames += 1
        self.stats.payload_bytes += frame.nbytes

    def _wait(self) -> None:
        for work, _ in self._in_flight:
            work.wait()
        self._in_flight = []

    def finish(self) -> PushStats:
        self._flush_dense()
        self._flush_sparse()
        self._wait()
        self._buffer = self._spare = None
        self.group.broadcast(torch.zeros(1, dtype=torch.int64, device=self.group.device))
        return self.stats


def read_frames(group: TransferGroup) -> Iterator[tuple[Frame, list[torch.Tensor]]]:
    """A worker's side of one sender's push: each frame and its payload (fresh buffers), until the
    sender's end marker."""
    while True:
        length = torch.zeros(1, dtype=torch.int64, device=group.device)
        group.broadcast(length)
        if int(length.item()) == 0:
            return
        header = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
        group.broadcast(header)
        frame = Frame.from_json(json.loads(bytes(header.cpu().tolist()).decode()))
        if frame.kind == "dense":
            parts = [torch.empty(frame.numel, dtype=frame.torch_dtype, device=group.device)]
        else:
            parts = [torch.empty(frame.numel, dtype=getattr(torch, frame.index_dtype), device=group.device),
                     torch.empty(frame.numel, dtype=frame.torch_dtype, device=group.device)]
        for flat in parts:
            group.broadcast(flat)
        yield frame, parts


def read_frames_ahead(groups: Sequence[TransferGroup]) -> Iterator[tuple[Frame, list[torch.Tensor]]]:
    """Every group's frames in turn (``read_frames``), received on a thread one frame ahead of the
    consumer: the next bucket crosses the wire while vLLM loads this one. At most two frames are
    received and not yet given up by the consumer (the one it holds, the one arriving); the thread
    asks for the next only once the consumer has taken the last. Errors reach the consumer."""
    handoff: queue.Queue[tuple[str, Any]] = queue.Queue()
    room = threading.Semaphore(1)
    stop = threading.Event()

    def receive() -> None:
        try:
            for group in groups:
                for item in read_frames_gated(group, room, stop):
                    handoff.put(("frame", item))
                if stop.is_set():
                    return
            handoff.put(("end", None))
        except BaseException as err:  # noqa: BLE001 -- re-raised in the consumer
            handoff.put(("error", err))

    def read_frames_gated(group: TransferGroup, room: threading.Semaphore, stop: threading.Event):
        frames = read_frames(group)
        while True:
            room.acquire()
            if stop.is_set():
                return
            item = next(frames, None)
            if item is None:
                room.release()  # the next group's first frame may come at once
                return
            yield item

    thread = threading.Thread(target=receive, name="megathunder-weights-rx", daemon=True)
    thread.start()
    finished = False
    try:
        while True:
            kind, item = handoff.get()
            if kind == "end":
                finished = True
                return
            if kind == "error":
                finished = True
                raise item
            room.release()  # taken: the thread may receive the next frame
            yield item
    finally:
        if finished:
            thread.join()
        else:  # the consumer gave up (its own error): the thread stops at its next frame boundary
            stop.set()
            room.release()


def dense_tensors(frame: Frame, payload: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Named views of a dense frame's payload (no copies)."""
    (flat,) = payload
    for slot in frame.slots:
        yield slot.name, flat[slot.offset : slot.offset + math.prod(slot.shape)].view(slot.shape)


def sparse_patches(frame: Frame, payload: list[torch.Tensor]) -> Iterator[tuple[Slot, torch.Tensor, torch.Tensor]]:
    """(slot, flat indices, values) of a sparse frame (views)."""
    indices, values = payload
    for slot in frame.slots:
        assert slot.count is not None
        yield slot, indices[slot.offset : slot.offset + slot.count], values[slot.offset : slot.offset + slot.count]


# ---------------------------------------------------------------------- the engine's side


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the groups meet: the store at ``host:port``; group ``s`` (of ``num_senders``)
    has ``world_size`` ranks; senders cast to ``dtype`` (the workers' model dtype)."""

    host: str
    port: int
    world_size: int
    backend: str
    num_senders: int = 1
    dtype: str = "float32"
    bucket_bytes: int = 256 * 2**20
    sparse_threshold: float = 0.0

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> Rendezvous:
        return cls(**json.loads(text))

    @staticmethod
    def prefix(sender: int) -> str:
        return f"megathunder-weights/{sender}"

    def join(self, sender: int, rank: int, device: torch.device) -> TransferGroup:
        """Connect to the store and join group ``sender`` as ``rank`` (blocks until all have)."""
        store = TCPStore(self.host, self.port, is_master=False, timeout=TIMEOUT)
        return TransferGroup(store, self.prefix(sender), rank, self.world_size, self.backend, device)


@dataclass(frozen=True)
class StageSenders:
    """The learner's stage senders, for an engine to open its groups with: ``join(rendezvous_json)``
    makes each of the ``num_stages`` senders join its group (``megathunder.learner.push``) and
    returns once they have."""

    num_stages: int
    join: Callable[[str], Awaitable[Any]]


class WeightTransfer:
    """An engine's transfer groups: the store (served here), the rendezvous, and -- when no learner
    senders were given -- this process's own sender (rank 0 of the one group)."""

    def __init__(self, store: TCPStore, rdv: Rendezvous, local: TransferGroup | None) -> None:
        self.store, self.rdv, self.local = store, rdv, local
        self.last_received: dict[str, float] = {}
        """The last push, slowest worker: seconds in all (``total_s``) and blocked on the wire (``wait_s``)."""

    @classmethod
    async def open(cls, cfg: CollectiveTransfer, engines: Sequence[Rpc], senders: StageSenders | None = None,
                   ) -> WeightTransfer:
        """Serve the store; every worker of engine i joins every group as rank 1 + (workers of
        engines before i) + its rank in its engine; the senders join as rank 0 of theirs."""
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
        rdv = Rendezvous(cfg.host, store.port, world_size, backend, senders.num_stages if senders else 1,
                         dtypes.pop() if dtypes else "float32", int(cfg.bucket_mb * 2**20), cfg.sparse_threshold)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        joining = asyncio.gather(*(
            rpc(WeightLoadCall("megathunder_transfer_join", args=(rdv.to_json(), str(offset))))
            for rpc, offset in zip(engines, offsets, strict=True)
        ))
        if senders is None:
            _, local = await asyncio.gather(joining, asyncio.to_thread(
                TransferGroup, store, rdv.prefix(0), 0, world_size, backend, device))
            return cls(store, rdv, local)
        await asyncio.gather(joining, senders.join(rdv.to_json()))
        return cls(store, rdv, None)

    async def receive(self, rpc: Rpc, send: Callable[[], Awaitable[Any]]) -> Any:
        """The workers receive (one RPC) while ``send()`` broadcasts, concurrently; fails as soon as
        either side does (a worker that fails stops receiving: its error now, not after the
        broadcast times out). Returns what ``send()`` returned."""
        receiving = asyncio.ensure_future(rpc(WeightLoadCall("megathunder_receive_stream")))
        self.last_received = {}
        sending = asyncio.ensure_future(send())
        try:
            done, _ = await asyncio.wait((receiving, sending), return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:  # the engine is gone (a weight update's guard): neither is awaited again
            # (only the asyncio side: a sender thread, or the learner's ranks, stay in their broadcast until
            # it fails -- at once over gloo when the workers are killed -- or until the groups' timeout)
            for task in (receiving, sending):
                task.cancel()
                task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no "never retrieved"
            raise
        if sending in done and sending.exception() is not None and receiving not in done:
            # a sender fails when a worker's end of the group goes: the worker's error says why
            await asyncio.wait((receiving,), timeout=RECEIVER_ERROR_GRACE_S)
        for task in (receiving, sending):
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        received = [json.loads(r) for r in await receiving]
        self.last_received = {key: max(r[key] for r in received) for key in ("total_s", "wait_s")} if received else {}
        return await sending

    async def push_local(self, named_tensors: Iterable[tuple[str, torch.Tensor]], rpc: Rpc) -> PushStats:
        """Tensors held by this process (no learner senders), bucket by bucket."""
        if self.local is None:
            raise RuntimeError("this engine's weights come from the learner's stage senders (StreamedWeights); "
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

        return await self.receive(rpc, lambda: asyncio.to_thread(send))

    async def close(self, rpc: Rpc) -> None:
        try:
            await rpc(WeightLoadCall("megathunder_transfer_close"))
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Close only what this process holds (the engine's workers are gone or cannot be asked)."""
        if self.local is not None:
            self.local.close()


async def open_transfer(cfg: EngineConfig, engines: Sequence[Rpc], senders: StageSenders | None) -> WeightTransfer | None:
    """The transfer groups for ``engines`` (one RPC each) when ``cfg`` asks for them."""
    wt = cfg.weight_transfer
    if not isinstance(wt, CollectiveTransfer):
        return None
    return await WeightTransfer.open(wt, engines, senders)


def weight_loader(weights: WeightSource, transfer: WeightTransfer | None) -> Callable[[Rpc], Awaitable[Any]]:
    """The load step of ``update_weights``, given the engine's RPC: the learner's senders
    (``StreamedWeights``) or in-memory tensors over the transfer groups, a checkpoint path (or
    anything without groups) by ``collective_rpc``. Made before the engine pauses, so that a bad
    source fails with the engine still serving."""
    if isinstance(weights, StreamedWeights):
        if transfer is None or transfer.local is not None:
            raise RuntimeError("StreamedWeights need an engine whose transfer groups were opened with the "
                               "learner's stage senders (weight_transfer.kind=collective, StageSenders)")
        send = weights.send
        return lambda rpc: transfer.receive(rpc, send)
    if transfer is not None and not isinstance(weights, str | os.PathLike):
        return lambda rpc: transfer.push_local(weights, rpc)
    call = weight_load_call(weights)
    return lambda rpc: rpc(call)
