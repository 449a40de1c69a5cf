"""megatron-core on a machine without CUDA: the few replacements it needs, in one place.

megatron-core assumes CUDA in a handful of ways (each one seen failing without this module):
CUDA RNG state in the tensor-parallel RNG tracker, ``torch.cuda.current_device()`` used as a device, ``torch.cuda.synchronize`` in the checkpoint writer, hard-coded
``device="cuda"`` tensors and ``.cuda()`` calls, and ``param.type()`` compared with
``torch.cuda.FloatTensor`` names in the optimizers. ``enable()`` maps all of these to the CPU:

- a ``TorchFunctionMode`` rewrites any CUDA device argument to ``cpu`` and makes ``Tensor.cuda()``
  a no-op; the autograd engine does not carry a Python function mode into backward passes, so
  the backward of every Python autograd function (Megatron's sequence-parallel linear layers
  allocate with ``device=torch.cuda.current_device()`` there; activation checkpointing re-runs the
  forward there) enters it too;
- the CUDA RNG functions are pointed at the CPU generator;
- ``torch.cuda.current_device`` / ``synchronize`` / ``set_device`` become harmless;
- ``Tensor.type()`` reports CPU float tensors under their CUDA names, which is what the optimizer
  checks expect of a parameter on the learner's device.

It is a no-op when CUDA is available, so the same learner code runs unchanged on GPUs.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False
_MODE: TorchFunctionMode | None = None


def _to_cpu_device(device):
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            first = args[1]
            if isinstance(first, (int, str, torch.device)) and not isinstance(first, bool):
                args = (args[0], _to_cpu_device(first), *args[2:])
        return func(*args, **kwargs)


_CUDA_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def enable() -> bool:
    """Install the CPU replacements once per process; returns whether they are active."""
    global _ENABLED, _MODE
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True
    from megatron.core.tensor_parallel import random as mp_random

    cpu_state = torch.random.get_rng_state
    torch.cuda.get_rng_state = lambda device=None: cpu_state()
    torch.cuda.set_rng_state = lambda state, device=None: torch.random.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: None  # the CPU generator is seeded by the caller
    torch.cuda.manual_seed_all = lambda seed: None
    mp_random._get_cuda_rng_state = lambda *a, **k: cpu_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.random.set_rng_state(state)
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.set_device = lambda device: None
    torch.cuda.device_count = lambda: 0

    original_type = torch.Tensor.type

    def _type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original_type(self)
            return _CUDA_NAMES.get(name, name)
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = _type
    from torch.autograd.function import BackwardCFunction

    backward_apply = BackwardCFunction.apply

    def _apply_with_mode(self, *args):
        if any(isinstance(m, _CudaToCpu) for m in torch.overrides._get_current_function_mode_stack()):
            return backward_apply(self, *args)
        with _CudaToCpu():
            return backward_apply(self, *args)

    BackwardCFunction.apply = _apply_with_mode
    _MODE = _CudaToCpu()
    _MODE.__enter__()
    _ENABLED = True
    return True


def enable_in_this_thread() -> None:
    """Torch function modes are per thread: call this first in any other thread that runs
    Megatron code (the trainer's learner thread does)."""
    if _ENABLED:
        _CudaToCpu().__enter__()


@contextlib.contextmanager
def suspended():
    """Run code that must see real devices (e.g. a transformers model) without the mapping."""
    if _MODE is None:
        yield
        return
    _MODE.__exit__(None, None, None)
    try:
        yield
    finally:
        _MODE.__enter__()
