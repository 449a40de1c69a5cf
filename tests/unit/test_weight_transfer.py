"""Weight transfer over gloo groups: frames, several senders in turn, sparse patches, failures, and
the controller's push (``WeightSync``) driving both ends.

vLLM workers are stood in for by ``MegathunderWorkerExtension`` itself on a fake worker (threads
here), whose ``reload_weights`` records what it was given: the code that runs inside vLLM is the
code under test, everything it talks to is real gloo. The engine's end is the engine's own
``WeightTransfer`` (``tests/weight_helpers.py``: ``FakeEngine``); the learner's stages are threads.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from megathunder.config import CollectiveTransfer, ConfigError, load_config
from megathunder.rollout.engines.transfer import WeightTransfer
from megathunder.trainer.weight_sync import WeightSync
from megathunder.weights.wire import Frame, FrameWriter, Rendezvous, Slot, both
from tests.weight_helpers import FakeEngine, FakeWorker, ThreadService, engine_rpc


def _weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (32,), (16, 8, 4), (), (100, 3), (7,), (256, 64)]
    out = []
    for i, shape in enumerate(shapes):
        dtype = (torch.float32, torch.bfloat16, torch.int64)[i % 3]
        out.append((f"layer.{i}.weight", torch.randn(shape, generator=g).mul(100).to(dtype)))
    return out


_engine_rpc = engine_rpc


def test_frame_header_round_trips_through_json():
    frame = Frame("sparse", "bfloat16", 10, (), "int32")
    assert Frame.from_json(json.loads(json.dumps(frame.to_json()))) == frame


def test_in_memory_push_reaches_two_workers_of_two_engines_exactly():
    """The engine's own sender (no learner): buckets of mixed dtypes, one tensor larger than a
    bucket; both workers reload exactly the sent tensors, in order."""
    weights = _weights()
    workers = [FakeWorker(), FakeWorker()]

    async def main():
        cfg = CollectiveTransfer(host="127.0.0.1", backend="gloo", bucket_mb=2048 / 2**20)
        transfer = await WeightTransfer.open_local(cfg, [w.rpc for w in workers])
        assert transfer.rdv.world_size == 3 and transfer.rdv.num_senders == 1
        stats = await transfer.push_local(iter(weights), _engine_rpc(workers))
        await transfer.close(_engine_rpc(workers))
        return stats

    stats = asyncio.run(main())
    for w in workers:
        assert list(w.loaded) == [n for n, _ in weights]
        assert all(torch.equal(w.loaded[n], t) and w.loaded[n].dtype == t.dtype for n, t in weights)
    assert stats.num_tensors == len(weights) and stats.num_frames >= 4  # 2 KiB buckets
    assert stats.payload_bytes == sum(t.numel() * t.dtype.itemsize for _, t in weights)


class StageThreads:
    """The learner's ``LearnerEndpoint`` weight calls, its pipeline stages stood in for by threads:
    each joins its group and pushes its tensors (dense, or as ``patches[stage]``: name -> (indices,
    values)); ``send_weights`` returns each stage's ``PushStats``."""

    def __init__(self, stage_tensors: list[list[tuple[str, torch.Tensor]]], bucket_bytes: int) -> None:
        self.stage_tensors, self.bucket_bytes = stage_tensors, bucket_bytes
        self.groups: list = [None] * len(stage_tensors)
        self.patches: list[dict] | None = None
        self.fail_send = False

    def _each_stage(self, fn):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(self.stage_tensors)) as pool:
            return list(pool.map(fn, range(len(self.stage_tensors))))

    def join_weight_transfer(self, rdv_json: str) -> None:
        rdv = Rendezvous.from_json(rdv_json)
        self.groups = self._each_stage(lambda s: rdv.join(s, 0, torch.device("cpu")))

    def send_weights(self) -> list:
        def one(s):
            writer = FrameWriter(self.groups[s], self.bucket_bytes)
            for name, t in self.stage_tensors[s]:
                if self.patches and name in self.patches[s]:
                    writer.add_sparse(name, t.shape, *self.patches[s][name])
                else:
                    writer.add(name, t.shape, t)
                if self.fail_send:
                    raise RuntimeError("a stage's sender failed")
            return writer.finish()
        return self._each_stage(one)

    def close(self) -> None:
        for group in self.groups:
            group.close()


def test_stage_senders_push_in_turn_and_sparse_patches_equal_the_dense_push():
    """Two senders (pipeline stages), one worker keeping a copy, driven by ``WeightSync``: connect,
    a dense push, then a push where stage 1 sends one tensor as a patch of its changed elements --
    the worker reloads tensors equal, bit for bit, to the new ones; each push is pause, receive,
    resume."""
    g = torch.Generator().manual_seed(1)
    stage0 = [("model.embed_tokens.weight", torch.randn(50, 8, generator=g).to(torch.bfloat16)),
              ("model.layers.0.mlp.up_proj.weight", torch.randn(12, 8, generator=g).to(torch.bfloat16))]
    stage1 = [("model.layers.1.mlp.up_proj.weight", torch.randn(12, 8, generator=g).to(torch.bfloat16)),
              ("model.norm.weight", torch.randn(8, generator=g).to(torch.bfloat16))]
    worker = FakeWorker(dtype=torch.bfloat16)
    stages = StageThreads([stage0, stage1], bucket_bytes=256)
    cfg = CollectiveTransfer(host="127.0.0.1", backend="gloo", bucket_mb=256 / 2**20, sparse_threshold=0.5)
    engine = FakeEngine([[worker]], cfg)
    sync = WeightSync(engine, ThreadService(stages), cfg, num_stages=2, endpoint=StageThreads)  # type: ignore[arg-type]

    async def main():
        await sync.connect()
        transfer = engine.transfer
        assert transfer.local is None and transfer.rdv.dtype == "bfloat16" and transfer.rdv.num_senders == 2
        first = await sync.push(1)
        dense = {n: t.clone() for n, t in worker.loaded.items()}
        # the second push: three elements of one tensor changed, sent as a patch
        name, old = stage1[0]
        new = old.clone()
        idx = torch.tensor([0, 17, 95])
        new.view(-1)[idx] += 1
        stage1[0] = (name, new)
        stages.patches = [{}, {name: (idx.to(torch.int32), new.view(-1)[idx])}]
        second = await sync.push(2)
        await engine.close()
        stages.close()
        return first, second, dense

    first, second, dense = asyncio.run(main())
    assert engine.events == ["open", "pause", "receive", "resume", "pause", "receive", "resume"]
    assert engine.policy_version == 2 and transfer_received(engine)
    assert sorted(worker.loaded) == sorted(n for n, _ in stage0 + stage1)  # the whole copy, reloaded
    for n, t in stage0 + stage1:
        assert torch.equal(worker.loaded[n], t), n
    assert not torch.equal(dense[stage1[0][0]], stage1[0][1])
    assert sum(s.num_sparse_tensors for s in second) == 1 and second[1].changed_elements == 3 + 8
    assert second[1].payload_bytes == 3 * (4 + 2) + 8 * 2  # int32 index + bf16 value; the norm dense
    assert sum(s.num_frames for s in first) >= 3


def transfer_received(engine: FakeEngine) -> bool:
    """The last push's worker timings were recorded (``WeightTransfer.last_received``)."""
    return set(engine.transfer.last_received) == {"total_s", "wait_s"}


def test_groups_that_lost_a_worker_are_opened_again_inside_the_next_push():
    """An engine whose groups no longer hold every worker (a server lost, an engine core restarted:
    ``transfer_open`` false) gets new groups inside the next push, after its pause: the stages'
    senders join them again, then the push goes through them."""
    weights = _weights()[:3]
    worker = FakeWorker()
    stages = StageThreads([[(n, t.float()) for n, t in weights]], bucket_bytes=2048)
    cfg = CollectiveTransfer(host="127.0.0.1", backend="gloo", bucket_mb=2048 / 2**20)
    engine = FakeEngine([[worker]], cfg)
    service = ThreadService(stages)
    sync = WeightSync(engine, service, cfg, num_stages=1, endpoint=StageThreads)  # type: ignore[arg-type]

    async def main():
        await sync.connect()
        await sync.push(1)
        first_port = engine.transfer.rdv.port
        engine.transfer.joined = False  # as an engine reports groups that lost a worker
        await sync.push(2)
        assert engine.transfer.rdv.port != first_port
        await engine.close()
        stages.close()

    asyncio.run(main())
    assert engine.events == ["open", "pause", "receive", "resume", "pause", "open", "receive", "resume"]
    assert service.calls == ["join_weight_transfer", "send_weights", "join_weight_transfer", "send_weights"]
    assert all(torch.equal(worker.loaded[n], t.float()) for n, t in weights)


def test_a_failed_push_leaves_the_engine_paused_with_the_workers_error():
    """A sender that fails mid-push fails its broadcast; the worker's end of the group then fails
    too, and the push raises -- no resume: the engine stays paused."""
    worker = FakeWorker()
    worker.fail_on_receive = True
    stages = StageThreads([[("w", torch.ones(4))]], bucket_bytes=2048)
    cfg = CollectiveTransfer(host="127.0.0.1", backend="gloo", bucket_mb=2048 / 2**20)
    engine = FakeEngine([[worker]], cfg)
    sync = WeightSync(engine, ThreadService(stages), cfg, num_stages=1, endpoint=StageThreads)  # type: ignore[arg-type]

    async def main():
        await sync.connect()
        original = worker.megathunder_receive_stream

        def receive_then_leave():
            try:
                return original()
            finally:  # as a worker process that died would: its end of the group is gone
                worker.megathunder_transfer_close()

        worker.megathunder_receive_stream = receive_then_leave
        with pytest.raises(RuntimeError, match="worker failed to load"):
            await asyncio.wait_for(sync.push(1), 60)

    asyncio.run(main())
    assert engine.events == ["open", "pause", "receive"] and engine.policy_version == 0
    stages.close()


def test_a_patch_without_a_copy_to_patch_is_an_error(monkeypatch):
    import megathunder.rollout.engines.worker_extension as ext

    frame = Frame("sparse", "float32", 1, (Slot("w", (4,), 0, 1),))
    monkeypatch.setattr(ext, "read_frames_ahead", lambda groups: iter([(frame, [torch.zeros(1, dtype=torch.int32),
                                                                                torch.ones(1)])]))
    with pytest.raises(RuntimeError, match="no dense copy"):
        ext._update_shadow([object()], {}, ext._WaitClock())


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["rollout.engine.weight_transfer=nccl"], "rollout.engine.weight_transfer.kind"),
        (["rollout.engine.weight_transfer.backend=mpi"], "rollout.engine.weight_transfer.backend"),
        (["rollout.engine.weight_transfer.bucket_mb=0"], "rollout.engine.weight_transfer.bucket_mb"),
        (["rollout.engine.weight_transfer.sparse_threshold=2"], "rollout.engine.weight_transfer.sparse_threshold"),
        (["rollout.engine.deployment=server", "rollout.engine.api_key_env=K",
          'rollout.engine.server_urls=["http://10.0.0.5:8100"]'], "rollout.engine.weight_transfer.host"),
    ],
)
def test_bad_transfer_configs_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert f"\n  {field}" in str(err.value), str(err.value)


def test_collective_is_the_default_and_rpc_the_explicit_fallback():
    cfg = load_config(None, [])
    assert isinstance(cfg.rollout.engine.weight_transfer, CollectiveTransfer)
    assert cfg.rollout.engine.weight_transfer.backend == "auto"
    assert load_config(None, ["rollout.engine.weight_transfer=rpc"]).rollout.engine.weight_transfer.kind == "rpc"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_nccl_without_cuda_fails_when_the_engine_starts_not_at_parse_time():
    """A GPU job's config validates anywhere (a CPU-only login node); the transfer group refuses."""
    load_config(None, ["rollout.engine.weight_transfer.backend=nccl"])
    with pytest.raises(ValueError, match="weight_transfer.backend: nccl needs a CUDA device"):
        asyncio.run(WeightTransfer.serve(CollectiveTransfer(backend="nccl"), [], 1))


def test_a_worker_that_fails_fails_the_push_at_once():
    """A worker's error reaches the caller without waiting for the broadcast's timeout."""
    worker = FakeWorker()

    async def main():
        transfer = await WeightTransfer.open_local(CollectiveTransfer(backend="gloo", bucket_mb=2048 / 2**20),
                                                   [worker.rpc])
        worker.fail_on_receive = True
        original = worker.megathunder_receive_stream

        def receive_then_leave():
            try:
                return original()
            finally:  # as a worker process that died would: its end of the group is gone
                for group in worker.megathunder_groups or []:
                    group.close()

        worker.megathunder_receive_stream = receive_then_leave
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="worker failed to load"):
            await transfer.push_local(iter(_weights()), worker.rpc)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 30


def test_frames_are_received_one_ahead_of_the_loader_in_order(monkeypatch):
    """``read_frames_ahead``: every group's frames in order; while the loader holds frame k the
    thread receives k + 1 and no further (two frames at most); a receive error reaches the loader."""
    import threading

    import megathunder.weights.wire as transfer

    received: list[tuple[int, int]] = []
    lock = threading.Lock()

    def fake_read_frames(group):
        for k in range(group):
            with lock:
                received.append((group, k))
            yield (group, k), []

    monkeypatch.setattr(transfer, "read_frames", fake_read_frames)
    frames = transfer.read_frames_ahead([3, 2])
    taken = []
    for item, _ in frames:
        taken.append(item)
        deadline = time.monotonic() + 5
        while len(received) < min(len(taken) + 1, 5) and time.monotonic() < deadline:
            time.sleep(0.001)  # the thread receives the next frame while this one is "loaded" ...
        time.sleep(0.01)
        with lock:
            assert len(received) <= len(taken) + 1, (received, taken)  # ... and not the one after
    assert taken == [(3, 0), (3, 1), (3, 2), (2, 0), (2, 1)]

    def failing(group):
        yield ("ok", 0), []
        raise RuntimeError("the sender went away")

    monkeypatch.setattr(transfer, "read_frames", failing)
    frames = transfer.read_frames_ahead([1])
    assert next(frames)[0] == ("ok", 0)
    with pytest.raises(RuntimeError, match="the sender went away"):
        next(frames)


def test_a_cancelled_exchange_cancels_both_ends():
    """A weight update's guard fails the workers' receive when the engine died or hung under it
    (``InProcessEngine._guarded``), and a stop cancels the push: cancelled, ``both`` cancels the
    workers' RPC and the senders' broadcast with it, not left running unawaited."""

    async def main() -> None:
        never = asyncio.Event()
        exchange = asyncio.ensure_future(both(never.wait(), never.wait()))
        await asyncio.sleep(0.01)
        exchange.cancel()
        with pytest.raises(asyncio.CancelledError):
            await exchange
        for _ in range(3):
            await asyncio.sleep(0)
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(main())


def test_a_failing_sender_waits_for_the_workers_error_which_says_why():
    """A sender fails when a worker's end of its group goes: the worker's own error, arriving
    within the grace period, is the one raised; a worker's failure is raised at once."""

    async def main() -> None:
        async def sender_fails() -> None:
            raise RuntimeError("gloo: connection closed by peer")

        async def worker_fails(after_s: float) -> None:
            await asyncio.sleep(after_s)
            raise ValueError("worker: out of memory while loading")

        with pytest.raises(ValueError, match="out of memory"):
            await both(worker_fails(0.05), sender_fails(), grace_s=5.0)
        never = asyncio.Event()
        with pytest.raises(RuntimeError, match="connection closed"):  # no word from the workers in the grace
            await both(never.wait(), sender_fails(), grace_s=0.05)
        t0 = time.monotonic()
        with pytest.raises(ValueError):
            await both(worker_fails(0.0), never.wait())
        assert time.monotonic() - t0 < 1
        assert await both(asyncio.sleep(0, "rx"), asyncio.sleep(0, "tx")) == ("rx", "tx")

    asyncio.run(main())
