"""FLOPs of a training pass and the utilisation they give: one formula for ``megathunder bench
learner``, ``megathunder sweep`` and the trainer's per-step figure (metrics.jsonl, on GPUs).

Per token of a sequence of length s, a forward pass costs 2 N + 4 L h s FLOPs (N the parameters
a token goes through -- a MoE's active ones --, L layers of width h; 4 L h s: the attention scores
and their weighted sum over the s positions, PaLM's count) and a backward twice that, so a
training pass 6 N + 12 L h s. That is the *model* FLOPs (MFU's numerator). What the hardware
runs adds what activation recomputation repeats (``learner.activations.recompute``): full, one more
forward of each layer (2 N + 4 L h s, the embedding and output layer aside, counted in N here: an
upper bound by their share); selective (core attention), the attention part of the forward again
(4 L h s). Utilisation = FLOPs / (seconds x devices x peak FLOP/s): MFU with the model FLOPs, HFU
with the hardware's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from megathunder.plan.memory_plan import ModelShape

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "B200": 2250.0, "A100": 312.0}
"""Dense bf16 peak TFLOP/s per device, by a substring of its name (``torch.cuda.get_device_name``)."""


def peak_tflops(device_name: str) -> float | None:
    """The device's dense bf16 peak, or None for a device this table does not know (a CPU)."""
    return next((v for k, v in PEAK_TFLOPS.items() if k in device_name), None)


@dataclass(frozen=True)
class PassFlops:
    model: float  # 6 N + 12 L h s per token
    hardware: float  # ... plus what recomputation repeats


def training_flops(shape: ModelShape, lengths: Iterable[int], recompute: str = "none") -> PassFlops:
    """FLOPs of one forward and backward over sequences of ``lengths`` tokens (module docstring)."""
    n, lh = shape.active_params, shape.layers * shape.hidden
    model = hardware = 0.0
    for s in lengths:
        model += s * (6 * n + 12 * lh * s)
        if recompute == "full":
            hardware += s * (2 * n + 4 * lh * s)
        elif recompute == "selective":
            hardware += s * 4 * lh * s
    return PassFlops(model, model + hardware)


def utilisation(flops: float, seconds: float, devices: int, peak: float) -> float:
    """``flops`` done in ``seconds`` on ``devices`` of ``peak`` TFLOP/s each, as a fraction of their peak."""
    return flops / (seconds * devices * peak * 1e12) if seconds > 0 else 0.0


@dataclass(frozen=True)
class Utilisation:
    """A run's per-step MFU and HFU (``columns``): its model's shape and recomputation, its learner
    devices and their peak."""

    shape: ModelShape
    recompute: str
    devices: int
    peak: float  # TFLOP/s per device

    @classmethod
    def on_this_device(cls, shape: ModelShape, recompute: str, devices: int) -> Utilisation | None:
        """On a GPU this table knows (None elsewhere: a CPU has no meaningful peak here)."""
        import torch

        if not torch.cuda.is_available():
            return None
        peak = peak_tflops(torch.cuda.get_device_name())
        return None if peak is None else cls(shape, recompute, devices, peak)

    def columns(self, lengths: Iterable[int], seconds: float) -> dict[str, float]:
        """``mfu`` and ``hfu`` of a step that trained sequences of ``lengths`` in ``seconds``."""
        f = training_flops(self.shape, lengths, self.recompute)
        return {"mfu": utilisation(f.model, seconds, self.devices, self.peak),
                "hfu": utilisation(f.hardware, seconds, self.devices, self.peak)}
