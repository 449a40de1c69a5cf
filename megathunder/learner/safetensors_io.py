"""Safetensors checkpoints read a slice at a time and written a tensor at a time.

**Reading** (:class:`CheckpointReader`): a directory of ``*.safetensors`` files (one file, or HF's
sharded layout with or without ``model.safetensors.index.json``). A read returns one tensor, or a
row range or column range of it, through safetensors' ``safe_open(...).get_slice``: the file is
mmap'd and only the requested bytes are copied into the returned tensor. The file is opened per
read, so at most one tensor's pages are mapped into the process at a time (a column range touches
every row, i.e. up to the whole tensor's pages, until the read returns). A rank that reads only its
own shards therefore peaks at its shards plus one tensor, whatever the checkpoint's size.

**Writing** (:class:`StreamingWriter`): safetensors is a little-endian u64 header length, a JSON
header giving each tensor's dtype, shape and byte range, then the tensors' bytes back to back.
Every byte range follows from the names, shapes and dtypes alone, so the header is written first
and then each tensor as it arrives -- the writer never holds more than the tensor being written.
The file it produces is byte-for-byte a regular safetensors file (``safetensors.safe_open`` and
``load_file`` read it; the tests check a round trip).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import torch
from safetensors import safe_open

from megathunder.config import ConfigError

INDEX_NAME = "model.safetensors.index.json"

_DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def weight_files(hf_dir: str | Path) -> list[Path]:
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"learner.model.hf_checkpoint: no *.safetensors files in {hf_dir}")
    return files


class CheckpointReader:
    """Lazy, per-tensor access to the safetensors files of ``hf_dir``."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.hf_dir = Path(hf_dir)
        self.file_of: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for f in weight_files(hf_dir):
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    self.file_of[name] = f
                    self._shapes[name] = tuple(handle.get_slice(name).get_shape())

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def shape(self, name: str) -> tuple[int, ...]:
        self._check(name)
        return self._shapes[name]

    def _check(self, name: str) -> None:
        if name not in self.file_of:
            raise KeyError(f"checkpoint {self.hf_dir} has no tensor {name}")

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor."""
        self._check(name)
        with safe_open(str(self.file_of[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """``tensor[start:stop]`` (dim 0), reading only those rows."""
        self._check(name)
        with safe_open(str(self.file_of[name]), framework="pt") as handle:
            return handle.get_slice(name)[start:stop]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        """``tensor[:, start:stop]`` of a matrix, reading only those columns."""
        self._check(name)
        with safe_open(str(self.file_of[name]), framework="pt") as handle:
            return handle.get_slice(name)[:, start:stop]


class StreamingWriter:
    """One safetensors file, written tensor by tensor in the order ``layout`` gives.

    ``layout`` is ``[(name, shape, dtype), ...]``; :meth:`write` must then be called once per entry,
    in that order, with a tensor of that shape and dtype (checked).
    """

    def __init__(self, path: str | Path, layout: Sequence[tuple[str, Sequence[int], torch.dtype]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        self._expected: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        offset = 0
        for name, shape, dtype in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._expected.append((name, tuple(shape), dtype))
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.path = Path(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed by close() / the context manager)
        self._file.write(struct.pack("<Q", len(text)) + text)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._expected):
            raise ValueError(f"{self.path}: {name} is one tensor more than the header lists")
        want_name, want_shape, want_dtype = self._expected[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != (want_name, want_shape, want_dtype):
            raise ValueError(f"{self.path}: got {name} {tuple(tensor.shape)} {tensor.dtype}, the header "
                             f"expects {want_name} {want_shape} {want_dtype} next")
        data = tensor.detach().to("cpu").contiguous()
        if data.numel():
            self._file.write(memoryview(data.view(torch.uint8).reshape(-1).numpy()))
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._expected):
            raise ValueError(f"{self.path}: {len(self._expected) - self._next} tensors of the header never written")

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


def write_index(hf_dir: str | Path, weight_map: dict[str, str], total_size: int) -> Path:
    """HF's ``model.safetensors.index.json`` for a sharded checkpoint."""
    path = Path(hf_dir) / INDEX_NAME
    path.write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
                               indent=2) + "\n")
    return path


def load_dir(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory in one dict (tests and small tools only: the whole model)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in weight_files(hf_dir):
        out.update(load_file(str(f)))
    return out


def has_weights(hf_dir: str | Path) -> bool:
    return any(Path(hf_dir).glob("*.safetensors"))
