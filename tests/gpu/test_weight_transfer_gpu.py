"""The collective weight transfer on NCCL, run by ``tools/gpu_check.sh``; skipped without 2 GPUs.

The same code as the gloo path (``megathunder.rollout.engines.transfer``) with the backend
switched: rank 0 (a ``WeightSender`` on cuda:0) pushes bf16 + fp32 tensors in several buckets to
a worker rank in another process on cuda:1 (NCCL needs one device per rank), which receives them
with ``receive`` -- the method vLLM workers run -- and checks them bit for bit. vLLM itself is
not needed (the GPU machine may not have it): a queue stands in for ``collective_rpc``.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (one per NCCL rank)")

BUCKET_BYTES = 1 << 20


def _weights(device: str) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(12):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        out.append((f"model.layers.{i}.w", torch.randn(256, 384, generator=g).to(dtype).to(device)))
    return out


def _worker(calls: mp.Queue, results: mp.Queue) -> None:
    """A stand-in vLLM worker: joins, receives pushes, closes, as the extension methods do."""
    from megathunder.rollout.engines.transfer import Bucket, Rendezvous, TransferGroup, receive

    torch.cuda.set_device(1)
    group = None
    while True:
        method, args = calls.get()
        if method == "megathunder_worker_rank":
            results.put([0])
        elif method == "megathunder_transfer_join":
            group = TransferGroup.join(Rendezvous.from_json(args[0]), int(args[1]), torch.device("cuda", 1))
            results.put(group.rank)
        elif method == "megathunder_receive_buckets":
            plan = [Bucket.from_json(b) for b in json.loads(args[0])]
            expected = dict(_weights("cuda:1"))
            got = [(name, t.clone()) for name, t in receive(group, plan)]
            results.put(len(got) == len(expected) and all(torch.equal(t, expected[n]) for n, t in got))
        else:
            group.close()
            results.put(None)
            return


def test_nccl_push_reaches_a_worker_on_another_gpu():
    from megathunder.rollout.engines.transfer import WeightSender

    ctx = mp.get_context("spawn")
    calls, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_worker, args=(calls, results))
    proc.start()

    async def rpc(call):
        calls.put((call.method, call.args))
        return await asyncio.to_thread(results.get, True, 300)

    async def main() -> bool:
        torch.cuda.set_device(0)
        sender = await WeightSender.open("127.0.0.1", "nccl", [rpc], BUCKET_BYTES)
        assert sender.group.device.type == "cuda"
        ok = await sender.push(iter(_weights("cuda:0")), rpc)  # the worker's check of what it got
        await sender.close(rpc)
        return ok

    try:
        assert asyncio.run(main()) is True
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
