"""Parameter-sized gradient buffers: the only thing the ledger knows about a model.

A ``GradBuffer`` is a list of flat tensors laid out like the backend's gradient storage (one flat
tensor for a plain torch model; one per Megatron gradient buffer for the Megatron learner). The
ledger only adds scaled buffers together, so any backend that can expose its gradient storage in
this form can plug in.

``BufferPool`` is the one place these buffers come from, and it counts them and their bytes. Two
kinds: *accumulators* (P, P_A: the gradient's own dtype, on the gradient's device) and *slot*
buffers (a group's S_g and R_g, and a trajectory's pending h_i), whose dtype and placement are
``ledger.slot_dtype`` / ``ledger.slot_placement``. Every operation on a slot goes through the pool:

    slot_write(slot, h, alpha, first)    slot = h  or  slot += alpha * h   (h: the live gradient;
                                         slot_writes: several slots from one h)
    slot_add(slot, pend, alpha, first)   the same, from a pending buffer   (same dtype, placement;
                                         host-placed, queued like a write: the fold of a pending
                                         h_i runs beside the next backward)
    fold(acc, slot, alpha)               acc += alpha * slot               (group close; a pending
                                                                            h_i into P)

Why the placements give the same update. A device-placed slot runs exactly these two tensor ops.
A host-placed slot runs the same two ops on the same values, only elsewhere: ``slot_write`` first
copies h (fp32, exact) into a staging buffer -- on a GPU a device buffer, so the live storage is
free for the next backward at once, then an asynchronous copy on a side stream into pinned host
memory -- and a host thread waits for that copy and runs ``slot += alpha * staged`` while the next
trajectory's backward runs. ``fold`` copies the slot into the device staging buffer (bf16 -> fp32
is exact) and adds it there. The values entering every add are the same, so on a CPU learner
(where host and device are one memory and the same kernels run) the update is bitwise that of
device slots; on a GPU the host adds run on the CPU's kernels, so a bf16 slot may round its last
bit differently, within the same bound. Cost: one fp32 staging buffer on the device and one in
pinned host memory, at most one transfer in flight (the next ``slot_write`` waits for it).

Host writes that keep up (``ledger.host_threads``, ``ledger.host_chunk_mb``). A host write is a
D2H of 4B bytes (B parameters) and an add of B elements; one thread adds ~1e9 elements/s, so at a
32B model's TP8 x PP2 shard (B = 2.05e9) a write would hold the staging buffer ~2 s, longer than
the trajectory's backward. So: the add is split into chunks on ``host_threads`` threads (disjoint
slices, each element added by the same op with the same operands: bitwise the single thread's
result); on a GPU the D2H goes in chunks of ``host_chunk_mb``, each chunk added as soon as it is
on the host (the write then takes the longer of the two, not their sum); and a slot-path h_i that
goes into both S and R (``slot_writes``) is staged once and added into each, so it costs one D2H
and one wait, not two. Chunk boundaries are multiples of 4096 elements: every chunk runs the same
vectorised loop over its elements as the whole tensor would, so no element falls into a different
(scalar-tail) code path -- tested bitwise in ``tests/unit/test_ledger_memory.py``.

bf16 slots: the add is computed in fp32 and rounded to bf16 once, so a slot that received m
gradients carries at most m roundings of relative size u = 2^-8 each; the bound this gives on the
final gradient is derived in docs/exactness.md (section 2.7) and tested in
``tests/unit/test_ledger_memory.py``. Accumulators stay in the gradient's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal, Protocol

import torch

from megathunder.objectives import LossSpec
from megathunder.trajectory import Trajectory


class GradBuffer:
    __slots__ = ("tensors",)

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)

    @classmethod
    def zeros_like(cls, other: GradBuffer) -> GradBuffer:
        return cls([torch.zeros_like(t) for t in other.tensors])

    def zero_(self) -> GradBuffer:
        for t in self.tensors:
            t.zero_()
        return self

    def copy_(self, other: GradBuffer, non_blocking: bool = False) -> GradBuffer:
        torch._foreach_copy_(self.tensors, other.tensors, non_blocking=non_blocking)
        return self

    def add_(self, other: GradBuffer, alpha: float = 1.0) -> GradBuffer:
        if alpha == 1.0:
            torch._foreach_add_(self.tensors, other.tensors)
        else:
            torch._foreach_add_(self.tensors, other.tensors, alpha=alpha)
        return self

    def div_(self, value: float) -> GradBuffer:
        torch._foreach_div_(self.tensors, value)
        return self

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def flat(self) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in self.tensors])


class GradientBackend(Protocol):
    """What the ledger needs from a learner."""

    def zeros(self) -> GradBuffer:
        """A new zeroed buffer laid out like the gradient storage."""
        ...

    def backward(self, traj: Trajectory, specs: Sequence[LossSpec]) -> Iterator[GradBuffer]:
        """One forward of ``traj``; for each spec, the gradient of ``loss_i(spec)`` alone.

        Yields the backend's live gradient storage after each backward; the consumer must be done
        with it before asking for the next one (it is zeroed and overwritten).
        """
        ...

    def load_grad(self, grad: GradBuffer) -> None:
        """Make ``grad`` the model's gradient, ready for the data-parallel reduce and the optimizer."""
        ...

    # Optional: ``backward_sum(trajs, specs) -> GradBuffer``, the summed gradient of several
    # trajectories' losses in one pass (the live storage, valid until the next call). The ledger
    # uses it for the trajectories a closing group releases at once.
    # Optional: ``backward_each(items, on_grad)``, each (trajectory, its specs) item's gradients on
    # their own, as ``backward`` gives them, ``on_grad(k, j, live)`` after item k's j-th (one
    # schedule call on a pipelined learner). The ledger uses it for consecutive trajectories whose
    # work is a pass of their own (slot writes, pending h_i).


SLOT_DTYPES: dict[str, torch.dtype | None] = {"gradient": None, "bfloat16": torch.bfloat16}
"""``ledger.slot_dtype`` -> the slot buffers' dtype (None: the gradient storage's own)."""
Placement = Literal["device", "host"]


def slots_within_budget(max_slots: int | None, budget_gb: float | None, buffer_bytes: int,
                        buffers_per_slot: int) -> int | None:
    """K: ``max_slots`` (None = unbounded), lowered to the number of slots whose buffers fit in
    ``budget_gb`` GiB (each slot counted at ``buffers_per_slot`` buffers of ``buffer_bytes``)."""
    if budget_gb is None:
        return max_slots
    fit = int(budget_gb * 2**30) // (buffers_per_slot * max(buffer_bytes, 1))
    return fit if max_slots is None else min(max_slots, fit)


def pending_within_budget(max_pending: int | None, max_slots: int | None, budget_gb: float | None,
                          buffer_bytes: int, buffers_per_slot: int) -> int | None:
    """Pending buffers allowed: ``max_pending`` (None = the budget's), lowered to what ``budget_gb``
    GiB holds after K slots at their largest (``max_slots`` x ``buffers_per_slot`` buffers). Slots
    and pending buffers share one budget; the slots' share is reserved first, so a slot never finds
    its buffers taken and the live slot and pending buffers never exceed the budget together."""
    if max_pending == 0 or budget_gb is None:
        return max_pending
    assert max_slots is not None, "internal: a budget bounds K"
    rest = max(int(budget_gb * 2**30) // max(buffer_bytes, 1) - max_slots * buffers_per_slot, 0)
    return rest if max_pending is None else min(max_pending, rest)


Write = tuple[GradBuffer, float, bool]
"""One slot update: (slot, alpha, first) for ``slot = alpha * src`` (first) or ``slot += alpha * src``."""
CHUNK_ALIGN = 4096  # chunk boundaries, in elements: whole blocks of every vector width, never a new tail


def _chunks(template: GradBuffer, pieces: int, max_elements: int) -> list[tuple[int, int, int]]:
    """(tensor index, start, end) covering every tensor's elements: each tensor in at least
    ``pieces`` (for the threads) and at most ``max_elements`` per piece, boundaries on multiples
    of ``CHUNK_ALIGN`` elements."""
    out = []
    for k, t in enumerate(template.tensors):
        n = t.numel()
        size = min(-(-n // pieces), max_elements)
        size = max(CHUNK_ALIGN, -(-size // CHUNK_ALIGN) * CHUNK_ALIGN)
        out += [(k, a, min(a + size, n)) for a in range(0, n, size)] or [(k, 0, 0)]
    return out


def _write_flat(dst: torch.Tensor, src: torch.Tensor, alpha: float, first: bool) -> None:
    """``_write`` on one tensor (or one chunk of it): the same op per element."""
    if first and alpha == 1.0:
        dst.copy_(src)
        return
    if first:
        dst.zero_()
    if alpha == 1.0:
        dst.add_(src)
    else:
        dst.add_(src, alpha=alpha)


def _add_chunk(writes: Sequence[Write], src: GradBuffer, k: int, a: int, b: int,
               event: torch.cuda.Event | None) -> None:
    if event is not None:
        event.synchronize()  # this chunk's D2H is done
    part = src.tensors[k].view(-1)[a:b]
    for slot, alpha, first in writes:
        _write_flat(slot.tensors[k].view(-1)[a:b], part, alpha, first)


class _HostMover:
    """Adds into host-placed slots, overlapped with the next backward (module docstring).

    ``threads`` workers each add a chunk of every write (``_chunks``): elementwise ops on disjoint
    slices, so every element gets the op it gets from one thread, with the same operands --
    bitwise the same sums, in ~1/threads of the time where memory bandwidth allows. On a GPU the
    D2H goes in chunks of ``chunk_mb`` MiB on the side stream, each with an event its add waits
    for, so the adds run while later chunks are on the wire. A write of several slots from one
    gradient (``slot_writes``: S and R) stages it once and adds it into each."""

    def __init__(self, template: GradBuffer, threads: int = 1, chunk_mb: float = 0.0) -> None:
        self.cuda = any(t.is_cuda for t in template.tensors)
        if self.cuda:
            self.device_stage: GradBuffer | None = GradBuffer([torch.empty_like(t) for t in template.tensors])
            self.stream = torch.cuda.Stream()
        else:
            self.device_stage = None
        self.host_stage = GradBuffer([torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.cuda)
                                      for t in template.tensors])
        self.threads = threads
        itemsize = max(t.element_size() for t in template.tensors) if template.tensors else 4
        per_chunk = int(chunk_mb * 2**20) // itemsize if chunk_mb > 0 and self.cuda else 2**62
        self._chunks = _chunks(template, threads, per_chunk)
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="megathunder-host-slots")
        self._pending: list[Future] = []

    @property
    def device_bytes(self) -> int:
        return self.device_stage.nbytes if self.device_stage is not None else 0

    def wait(self) -> None:
        """Every queued host add has finished (its staging buffers are free)."""
        pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]  # waits for each, so none is left running
        for err in errors:
            if err is not None:
                raise err

    def write(self, writes: Sequence[Write], h: GradBuffer) -> None:
        """Stage ``h`` once, then add it into every slot of ``writes`` on the threads."""
        self.wait()
        events: list[torch.cuda.Event | None] = [None] * len(self._chunks)
        if self.device_stage is not None:
            self.device_stage.copy_(h)  # on the compute stream: h may be zeroed right after
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for j, (k, a, b) in enumerate(self._chunks):
                    self.host_stage.tensors[k].view(-1)[a:b].copy_(self.device_stage.tensors[k].view(-1)[a:b],
                                                                   non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self.stream)
                    events[j] = event
        else:
            self.host_stage.copy_(h)
        self._submit(writes, self.host_stage, events)

    def add(self, writes: Sequence[Write], src: GradBuffer) -> None:
        """``writes`` from a host buffer of the slots' kind (a pending gradient), queued on the
        threads like a ``write``: it returns at once and runs beside the next backward. ``src`` must
        stay untouched until it is done (``BufferPool.release`` keeps a released one out of reuse
        until then)."""
        self.wait()
        self._submit(writes, src, [None] * len(self._chunks))

    @property
    def busy(self) -> bool:
        return any(not f.done() for f in self._pending)

    def _submit(self, writes: Sequence[Write], src: GradBuffer, events: Sequence[torch.cuda.Event | None]) -> None:
        writes = list(writes)
        self._pending = [self._executor.submit(_add_chunk, writes, src, k, a, b, event)
                         for (k, a, b), event in zip(self._chunks, events, strict=True)]

    def fold(self, acc: GradBuffer, slot: GradBuffer, alpha: float) -> None:
        self.wait()
        if self.device_stage is not None:
            acc.add_(self.device_stage.copy_(slot), alpha=alpha)
        else:
            acc.add_(slot, alpha=alpha)


def _write(slot: GradBuffer, h: GradBuffer, alpha: float, first: bool) -> None:
    if first and alpha == 1.0:
        slot.copy_(h)
    else:
        if first:
            slot.zero_()
        slot.add_(h, alpha=alpha)


class BufferPool:
    """Hands out parameter-sized buffers and counts them and their bytes; freed buffers are
    reused, not freed. Accumulators come from the backend; slots in ``slot_dtype`` on
    ``slot_placement`` (module docstring)."""

    def __init__(self, backend: GradientBackend, slot_dtype: str = "gradient", slot_placement: Placement = "device",
                 host_threads: int = 1, host_chunk_mb: float = 0.0) -> None:
        self._backend = backend
        self.host_threads, self.host_chunk_mb = host_threads, host_chunk_mb
        self.slot_dtype = SLOT_DTYPES[slot_dtype]
        self.slot_placement: Placement = slot_placement
        self._free: dict[str, list[GradBuffer]] = {"acc": [], "slot": []}
        self._draining: list[GradBuffer] = []  # released slot buffers the mover may still touch
        self._kind: dict[int, str] = {}  # id(buffer) -> "acc" | "slot", for the buffers handed out
        self._template: GradBuffer | None = None  # the gradient storage's layout (first accumulator)
        self._mover: _HostMover | None = None
        self.num_live = 0
        self.peak_live = 0
        self.num_allocated = 0
        self.live_bytes = {"device": 0, "host": 0}
        self.peak_bytes = {"device": 0, "host": 0}

    # ------------------------------------------------------------------ buffers

    def acquire(self) -> GradBuffer:
        """An accumulator: zeroed, the gradient's dtype, on its device."""
        return self._take("acc", self._backend.zeros)

    def acquire_slot(self) -> GradBuffer:
        """A slot buffer, zeroed, in the slot dtype and placement."""
        return self._take("slot", self._new_slot)

    def release(self, bufs: Iterable[GradBuffer | None]) -> None:
        """Give buffers back. A host slot buffer the mover may still be reading or writing (a
        pending gradient whose add into its group's slot is queued) is not reused before the mover
        is done: it waits in ``_draining``, and the next ``_take`` of a slot that needs it waits for
        the mover first -- so releasing never blocks the learner thread."""
        given = [b for b in bufs if b is not None]
        for buf in given:
            kind = self._kind.pop(id(buf))
            if kind == "slot" and self._mover is not None and self._mover.busy:
                self._draining.append(buf)
            else:
                self._free[kind].append(buf)
            self.num_live -= 1
            self.live_bytes[self._where(kind)] -= buf.nbytes

    def reset_peak(self) -> None:
        self.peak_live = self.num_live
        self.peak_bytes = dict(self.live_bytes)
        if self._mover is not None:
            self.peak_bytes["device"] += self._mover.device_bytes
            self.peak_bytes["host"] += self._mover.host_stage.nbytes

    def slot_bytes(self, grad: GradBuffer) -> int:
        """Bytes of one slot buffer for a gradient laid out like ``grad``."""
        if self.slot_dtype is None:
            return grad.nbytes
        return grad.numel * self.slot_dtype.itemsize

    # ------------------------------------------------------------------ slot arithmetic

    def slot_write(self, slot: GradBuffer, h: GradBuffer, alpha: float = 1.0, first: bool = False) -> None:
        """``slot = alpha * h`` (first) or ``slot += alpha * h``; ``h`` (the backend's live storage)
        may be overwritten as soon as this returns."""
        self.slot_writes([(slot, alpha, first)], h)

    def slot_writes(self, writes: Sequence[Write], h: GradBuffer) -> None:
        """Every ``(slot, alpha, first)`` of ``writes`` from the live ``h`` (a group's S and R):
        host-placed, ``h`` goes down once and is added into each."""
        if self._mover is None:
            for slot, alpha, first in writes:
                _write(slot, h, alpha, first)
        else:
            self._mover.write(writes, h)

    def slot_add(self, slot: GradBuffer, src: GradBuffer, alpha: float = 1.0, first: bool = False) -> None:
        """``slot = alpha * src`` (first) or ``slot += alpha * src``, ``src`` another slot-kind buffer
        (a pending gradient): the same op as ``slot_write``, on buffers of one dtype and placement."""
        self.slot_adds([(slot, alpha, first)], src)

    def slot_adds(self, writes: Sequence[Write], src: GradBuffer) -> None:
        """``slot_add`` for every ``(slot, alpha, first)`` of ``writes``; host-placed, on the threads."""
        if self._mover is None:
            for slot, alpha, first in writes:
                _write(slot, src, alpha, first)
        else:
            self._mover.add(writes, src)

    def fold(self, acc: GradBuffer, slot: GradBuffer, alpha: float) -> None:
        """``acc += alpha * slot`` (an accumulator, a slot)."""
        if self._mover is None:
            acc.add_(slot, alpha=alpha)
        else:
            self._mover.fold(acc, slot, alpha)

    def sync(self) -> None:
        """Every queued slot add has finished."""
        if self._mover is not None:
            self._mover.wait()
        self._free["slot"] += self._draining
        self._draining = []

    # ------------------------------------------------------------------ internals

    def _where(self, kind: str) -> str:
        return "host" if kind == "slot" and self.slot_placement == "host" else "device"

    def _take(self, kind: str, new: Callable[[], GradBuffer]) -> GradBuffer:
        if kind == "slot" and self._draining and not self._free[kind]:
            self.sync()  # reuse a released buffer once the mover is done with it: no new allocation
        if self._free[kind]:
            buf = self._free[kind].pop().zero_()
        else:
            buf = new()
            self.num_allocated += 1
            if kind == "acc" and self._template is None:
                self._template = buf
        self._kind[id(buf)] = kind
        self.num_live += 1
        self.peak_live = max(self.peak_live, self.num_live)
        where = self._where(kind)
        self.live_bytes[where] += buf.nbytes
        staging = 0
        if self._mover is not None:
            staging = self._mover.device_bytes if where == "device" else self._mover.host_stage.nbytes
        self.peak_bytes[where] = max(self.peak_bytes[where], self.live_bytes[where] + staging)
        return buf

    def _new_slot(self) -> GradBuffer:
        template = self._template if self._template is not None else self._backend.zeros()
        self._template = template
        if self.slot_placement == "host":
            if self._mover is None:
                self._mover = _HostMover(template, self.host_threads, self.host_chunk_mb)
                self.peak_bytes["device"] = max(self.peak_bytes["device"], self.live_bytes["device"] + self._mover.device_bytes)
            pin = self._mover.cuda
            return GradBuffer([torch.zeros(t.shape, dtype=self.slot_dtype or t.dtype, device="cpu", pin_memory=pin)
                               for t in template.tensors])
        return GradBuffer([torch.zeros(t.shape, dtype=self.slot_dtype or t.dtype, device=t.device)
                           for t in template.tensors])
