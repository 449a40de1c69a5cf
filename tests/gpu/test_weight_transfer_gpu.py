"""The collective weight transfer on NCCL, run by ``tools/gpu_check.sh``; skipped without 2 GPUs.

The same code as the gloo path (``megathunder.weights.wire``, the engine's end
``megathunder.rollout.engines.transfer``) with the backend switched: this process serves the
groups and sends (``WeightTransfer.open_local`` / ``push_local``, on cuda:0) bf16 + fp32 tensors in
several buckets to a worker rank in another process on cuda:1 (NCCL needs one device per rank),
which joins and receives them as vLLM's workers do (``Rendezvous.join``, ``read_frames_ahead``,
``dense_tensors``) and checks them bit for bit. vLLM itself is not needed (the GPU machine may not
have it): a queue stands in for ``collective_rpc``.
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


def _worker(calls: mp.Queue, results: mp.Queue, device: str) -> None:
    """A stand-in vLLM worker (rank 0 of its engine): the extension's calls, on ``device``."""
    from megathunder.weights.wire import Rendezvous, dense_tensors, dtype_name, read_frames_ahead

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    groups: list = []
    got: list[tuple[str, torch.Tensor]] = []
    while True:
        method, args = calls.get()
        if method == "megathunder_worker_info":
            results.put([json.dumps({"rank": 0, "dtype": dtype_name(torch.float32)})])
        elif method == "megathunder_transfer_join":
            rdv = Rendezvous.from_json(args[0])
            groups = [rdv.join(s, int(args[1]), torch.device(device)) for s in range(rdv.num_senders)]
            results.put([groups[0].rank])
        elif method == "megathunder_receive_stream":
            got = [(name, t.clone()) for frame, payload in read_frames_ahead(groups)
                   for name, t in dense_tensors(frame, payload)]
            results.put([json.dumps({"tensors": len(got), "total_s": 0.0, "wait_s": 0.0})])
        elif method == "check":
            expected = dict(_weights(device))
            results.put([len(got) == len(expected) and all(torch.equal(t, expected[n]) for n, t in got)])
        else:  # megathunder_transfer_close
            for group in groups:
                group.close()
            results.put([None])
            return


def push_to_a_worker_process(backend: str, sender_device: str, worker_device: str) -> bool:
    """One push from this process into a worker process over ``backend``; the worker's check."""
    from megathunder.config import CollectiveTransfer
    from megathunder.rollout.engines.rpc import WeightLoadCall
    from megathunder.rollout.engines.transfer import WeightTransfer

    ctx = mp.get_context("spawn")
    calls, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_worker, args=(calls, results, worker_device))
    proc.start()

    async def rpc(call: WeightLoadCall) -> list:
        calls.put((call.method, call.args))
        return await asyncio.to_thread(results.get, True, 300)

    async def main() -> bool:
        if sender_device.startswith("cuda"):
            torch.cuda.set_device(torch.device(sender_device))
        cfg = CollectiveTransfer(host="127.0.0.1", backend=backend, bucket_mb=BUCKET_BYTES / 2**20)
        transfer = await WeightTransfer.open_local(cfg, [rpc])
        assert transfer.local is not None and transfer.local.device.type == torch.device(sender_device).type
        stats = await transfer.push_local(iter(_weights(sender_device)), rpc)
        assert stats.num_tensors == 12 and stats.num_frames > 1  # several buckets
        (ok,) = await rpc(WeightLoadCall("check"))
        await transfer.close(rpc)
        return ok

    try:
        return asyncio.run(main())
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()


def test_nccl_push_reaches_a_worker_on_another_gpu():
    assert push_to_a_worker_process("nccl", "cuda:0", "cuda:1") is True
