"""The wire of a weight push: frames over one process group per sender, and the rules both ends keep.

Below the learner and the rollout side alike: the learner's stage senders (``learner/push.py``)
write frames, the vLLM workers (``rollout/engines/worker_extension.py``) read them, the engine
(``rollout/engines/transfer.py``) serves the groups' store, and the controller
(``trainer/weight_sync.py``) runs both ends at once (:func:`both`). This module imports only torch
and the standard library.

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
  ``collective_rpc`` (``MegathunderWorkerExtension.megathunder_receive_stream``) that runs
  while the senders broadcast; the senders go in turn because every worker reads the groups in
  order. Dense tensors feed vLLM's in-place reloader as they arrive; with sparse patches enabled
  each worker keeps a copy of the weights in checkpoint layout (vLLM's CPU linear layers keep only
  their prepacked oneDNN form, so there is nothing to patch in place), patches it, and reloads from
  it.
- **Both ends at once** (:func:`both`): a broadcast returns only once every rank of its group has
  taken part, so neither end can go first and wait for the other -- the workers' receive and the
  senders' push run concurrently, as do the workers' join and the senders' join. The exchange fails
  as soon as either end does: a worker that fails stops receiving, and its error comes at once,
  not after the senders' broadcast times out.

Pipelined: a sender packs bucket k + 1 while bucket k is on the wire, and a worker receives frame
k + 1 (on a thread) while vLLM loads frame k, so a push takes about the slowest of the three
rather than their sum. Memory, per push: a sender holds two buckets (the one it packs, the one on
the wire) plus the parameter being converted; a worker two frames plus what vLLM's reloader keeps
of a layer whose tensors have not all arrived -- never a copy of the model (with sparse patches a
worker also keeps its copy).

The groups: a ``torch.distributed.TCPStore`` served by the engine's process on
``weight_transfer.host:port`` (port 0: a free one) and one ``ProcessGroupGloo`` or
``ProcessGroupNCCL`` per sender constructed directly on a prefix of it (:class:`Rendezvous`). Such
backends are never registered with ``torch.distributed``, so the learner's groups and vLLM's are
untouched and each group's ranks are its own. vLLM 0.32's weight-transfer engines
(``vllm.distributed.weight_transfer``: ``nccl_engine``, ``sparse_nccl_engine``, ``m2n_engine``,
``packed_tensor``) broadcast over vLLM's ``PyNcclCommunicator`` and CUDA streams only, so they
cannot run (or be tested) on CPU, and they have one trainer sender; the frames above are the same
idea over a backend chosen per machine. Sparse patches are vLLM's own format (flat indices into the
checkpoint tensor, values).
"""

from __future__ import annotations

import asyncio
import json
import math
import queue
import threading
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch.distributed import TCPStore

R = TypeVar("R")
S = TypeVar("S")

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


# ---------------------------------------------------------------------- the groups' meeting point


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


# ---------------------------------------------------------------------- both ends at once


async def both(receiving: Awaitable[R], sending: Awaitable[S], grace_s: float = RECEIVER_ERROR_GRACE_S) -> tuple[R, S]:
    """The workers' end and the senders' end of one exchange over the groups (a push, a join),
    run concurrently (module docstring, "Both ends at once"); returns both results. Fails as soon
    as either end does. A sender fails when a worker's end of its group goes, so when a sender
    fails first the workers' own error, which says why, is waited for up to ``grace_s`` and raised
    instead. The end that did not fail is left to finish by itself (its outcome is retrieved, never
    reported as unretrieved). Cancelled, it cancels both ends -- only their asyncio side: a thread
    in a broadcast, or the learner's ranks, stay there until the broadcast fails (at once over gloo
    when the workers are killed) or until the groups' ``TIMEOUT``."""
    receiver = asyncio.ensure_future(receiving)  # the workers' receives are posted first
    sender = asyncio.ensure_future(sending)
    ends = (receiver, sender)
    try:
        done, _ = await asyncio.wait(ends, return_when=asyncio.FIRST_EXCEPTION)
        if sender in done and _failed(sender) and receiver not in done:
            await asyncio.wait((receiver,), timeout=grace_s)
    except asyncio.CancelledError:  # neither end is awaited again
        for end in ends:
            end.cancel()
            end.add_done_callback(_retrieve)
        raise
    for end in ends:
        if _failed(end):
            for other in ends:
                other.add_done_callback(_retrieve)
            raise end.exception()  # type: ignore[misc]
    return receiver.result(), sender.result()


def _failed(end: asyncio.Future) -> bool:
    return end.done() and not end.cancelled() and end.exception() is not None


def _retrieve(end: asyncio.Future) -> None:
    if not end.cancelled():
        end.exception()
