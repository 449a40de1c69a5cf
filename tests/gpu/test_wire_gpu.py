"""The weight frames' writer and reader on CUDA tensors (``tools/gpu_check.sh``); skipped on CPU and
until ``megathunder.weights.wire`` exists (the wire module is being moved there).

NCCL cannot put two ranks on one GPU, so on one GPU the frames go over gloo with CUDA tensors on
both sides -- the sender's views and buckets on the device, the receiver's buffers on the device --
which is what a GPU learner and a GPU vLLM worker hand the group: the packing, the asynchronous
payloads and the headers are the same code whatever the backend (NCCL between two GPUs:
``tests/gpu/test_weight_transfer_gpu.py``, two GPUs). Dense buckets of bf16 and fp32, a tensor
larger than a bucket, a non-contiguous view (a transposed expert), and a sparse patch; the receiver
checks every tensor bit for bit."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.gpu_helpers import record

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BUCKET_BYTES = 1 << 16


def _weights() -> list[tuple[str, torch.Tensor]]:
    """On the GPU; the fourth a transposed view, the last larger than a bucket."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(6):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        out.append((f"model.layers.{i}.w", torch.randn(48, 40, generator=g).to(dtype).cuda()))
    out[3] = (out[3][0], out[3][1].t())
    out.append(("model.embed_tokens.weight", torch.randn(512, 64, generator=g).cuda()))  # 128 KiB > a bucket
    return out


def _patch() -> tuple[str, torch.Tensor, torch.Tensor]:
    idx = torch.tensor([0, 7, 1000, 1919], dtype=torch.int32)
    return "model.layers.0.w", idx.cuda(), torch.full((4,), 3.5).cuda()


def _group(wire, port: int, rank: int):
    from datetime import timedelta

    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(minutes=2))
    return wire.TransferGroup(store, "gpu-check", rank, 2, "gloo", torch.device("cuda", 0))


def _receiver(port: int, results: mp.Queue) -> None:
    wire = pytest.importorskip("megathunder.weights.wire")
    torch.cuda.set_device(0)
    group = _group(wire, port, 1)
    got: dict[str, torch.Tensor] = {}
    on_device = True
    for _push in range(2):  # the dense push, then the patch; each up to its sender's end marker
        for frame, payload in wire.read_frames(group):
            on_device &= all(p.is_cuda for p in payload)
            if frame.kind == "dense":
                got.update((n, t.clone()) for n, t in wire.dense_tensors(frame, payload))
            else:
                for slot, idx, values in wire.sparse_patches(frame, payload):
                    got[slot.name].view(-1)[idx.long()] = values
    expected = dict(_weights())
    name, idx, values = _patch()
    expected[name] = expected[name].clone()
    expected[name].view(-1)[idx.long()] = values
    ok = got.keys() == expected.keys() and all(torch.equal(got[n], expected[n].contiguous()) for n in expected)
    results.put({"ok": ok, "on_device": on_device, "num_tensors": len(got)})
    group.close()


@pytest.mark.gpu
def test_frames_of_cuda_tensors_arrive_bit_for_bit_over_gloo():
    wire = pytest.importorskip("megathunder.weights.wire",
                               reason="megathunder.weights.wire not there yet (the wire module is being moved)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, results))
    proc.start()
    try:
        group = _group(wire, port, 0)
        writer = wire.FrameWriter(group, BUCKET_BYTES)
        for name, tensor in _weights():
            writer.add(name, tensor.shape, tensor)
        writer.finish()
        writer = wire.FrameWriter(group, BUCKET_BYTES)  # a second push: one sparse patch
        name, idx, values = _patch()
        writer.add_sparse(name, (48, 40), idx, values)
        stats = writer.finish()
        got = results.get(timeout=120)
        group.close()
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    record("wire_frames_cuda_over_gloo", **got, sparse_frames=stats.num_frames)
    assert got == {"ok": True, "on_device": True, "num_tensors": 7}
