"""Parameter-sized gradient buffers: the only thing the ledger knows about a model.

A ``GradBuffer`` is a list of flat tensors laid out like the backend's gradient storage (one flat
tensor for a plain torch model; one per Megatron gradient buffer for the Megatron learner). The
ledger only adds scaled buffers together, so any backend that can expose its gradient storage in
this form can plug in.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

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

    def copy_(self, other: GradBuffer) -> GradBuffer:
        torch._foreach_copy_(self.tensors, other.tensors)
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


class BufferPool:
    """Hands out parameter-sized buffers and counts them; freed buffers are reused, not freed."""

    def __init__(self, backend: GradientBackend) -> None:
        self._backend = backend
        self._free: list[GradBuffer] = []
        self.num_live = 0
        self.peak_live = 0
        self.num_allocated = 0

    def acquire(self) -> GradBuffer:
        if self._free:
            buf = self._free.pop().zero_()
        else:
            buf = self._backend.zeros()
            self.num_allocated += 1
        self.num_live += 1
        self.peak_live = max(self.peak_live, self.num_live)
        return buf

    def release(self, bufs: Iterable[GradBuffer | None]) -> None:
        for buf in bufs:
            if buf is not None:
                self._free.append(buf)
                self.num_live -= 1

    def reset_peak(self) -> None:
        self.peak_live = self.num_live
