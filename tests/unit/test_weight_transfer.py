"""Bucketed weight transfer: plans, pack/unpack round trip, the size bound, a gloo broadcast."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from megathunder.config import ConfigError, load_config
from megathunder.rollout.engines.transfer import (
    Bucket,
    Rendezvous,
    TransferGroup,
    WeightSender,
    pack,
    plan_buckets,
    receive,
    unpack,
)


def _weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (16, 8, 4), (), (100, 3), (7,), (256, 64)]
    out = []
    for i, shape in enumerate(shapes):
        dtype = (torch.float32, torch.bfloat16, torch.int64)[i % 3]
        t = torch.randn(shape, generator=g).mul(100).to(dtype)
        out.append((f"layer.{i}.weight", t))
    return out


@pytest.mark.parametrize("bucket_bytes", [1, 1000, 8192, 2**20])
def test_plan_covers_every_tensor_once_within_the_bound(bucket_bytes):
    weights = _weights()
    plan = plan_buckets(weights, bucket_bytes)
    names = [s.name for b in plan for s in b.slots]
    assert sorted(names) == sorted(n for n, _ in weights)
    for b in plan:
        nbytes = b.numel * b.torch_dtype.itemsize
        assert nbytes <= bucket_bytes or len(b.slots) == 1  # a larger tensor travels alone
        assert {dict(weights)[s.name].dtype for s in b.slots} == {b.torch_dtype}
    if bucket_bytes == 2**20:
        assert len(plan) == 3  # one per dtype


def test_pack_unpack_round_trip_through_json():
    weights = _weights()
    tensors = dict(weights)
    for bucket in plan_buckets(weights, 4096):
        wire = Bucket.from_json(bucket.to_json())
        assert wire == bucket
        flat = pack(bucket, tensors, torch.device("cpu"))
        assert flat.numel() == bucket.numel and flat.dtype == bucket.torch_dtype
        for name, view in unpack(wire, flat):
            assert view.dtype == tensors[name].dtype and torch.equal(view, tensors[name])
            assert view.data_ptr() >= flat.data_ptr()  # a view of the bucket, not a copy


def _one_worker(on_receive):
    """Stands in for ``collective_rpc`` to one worker (rank 1, a thread): it joins the group and
    hands each push's plan to ``on_receive(group, plan_json)``."""

    async def rpc(call):
        if call.method == "megathunder_worker_rank":
            return [0]
        if call.method == "megathunder_transfer_join":
            rdv = Rendezvous.from_json(call.args[0])
            rpc.group = await asyncio.to_thread(TransferGroup.join, rdv, int(call.args[1]), torch.device("cpu"))
        elif call.method == "megathunder_receive_buckets":
            await on_receive(rpc.group, call.args[0])
        else:
            rpc.group.close()

    return rpc


def test_gloo_group_broadcasts_buckets_to_a_worker():
    """Rank 0 (a WeightSender) and one worker rank (a thread here) on one gloo group: the worker
    receives exactly the sent tensors, bucket by bucket."""
    weights = _weights()
    received: list[tuple[str, torch.Tensor]] = []

    async def on_receive(group, plan_json: str) -> None:
        plan = [Bucket.from_json(b) for b in json.loads(plan_json)]
        received.extend(await asyncio.to_thread(lambda: [(n, t.clone()) for n, t in receive(group, plan)]))

    rpc = _one_worker(on_receive)

    async def main():
        sender = await WeightSender.open("127.0.0.1", "gloo", [rpc], bucket_bytes=2048)
        assert sender.group.world_size == 2 and rpc.group.rank == 1
        await sender.push(iter(weights), rpc)
        await sender.close(rpc)

    asyncio.run(main())
    assert [n for n, _ in received] == [s.name for b in plan_buckets(weights, 2048) for s in b.slots]
    got = dict(received)
    for name, t in weights:
        assert torch.equal(got[name], t)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["rollout.engine.weight_transfer=nccl"], "rollout.engine.weight_transfer.kind"),
        (["rollout.engine.weight_transfer.backend=nccl"], "rollout.engine.weight_transfer.backend"),
        (["rollout.engine.weight_transfer.kind=collective", "rollout.engine.weight_transfer.bucket_mb=0"],
         "rollout.engine.weight_transfer.bucket_mb"),
    ],
)
def test_bad_transfer_configs_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert f"\n  {field}" in str(err.value), str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_nccl_without_cuda_fails_when_the_engine_starts_not_at_parse_time():
    """A GPU job's config validates anywhere (a CPU-only login node); the transfer group refuses."""
    load_config(None, ["rollout.engine.weight_transfer.kind=collective", "rollout.engine.weight_transfer.backend=nccl"])
    with pytest.raises(ValueError, match="weight_transfer.backend: nccl needs a CUDA device"):
        asyncio.run(WeightSender.open("127.0.0.1", "nccl", [], bucket_bytes=2**20))


def test_a_worker_that_fails_fails_the_push_at_once():
    """A worker's error reaches the caller without waiting for the broadcast's timeout."""
    import time

    async def on_receive(group, plan_json: str) -> None:
        group.close()  # as a worker process that died would: its end of the group is gone
        raise RuntimeError("worker failed to load")

    rpc = _one_worker(on_receive)

    async def main():
        sender = await WeightSender.open("127.0.0.1", "gloo", [rpc], bucket_bytes=2048)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="worker failed to load"):
            await sender.push(iter(_weights()), rpc)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 30
