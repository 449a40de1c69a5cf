"""One learner rank of a weight-push check, launched by torchrun from tests/distributed/test_push.py.

    python -m torch.distributed.run --nproc-per-node N push_worker.py --out FILE --hf DIR ...

The trainer's wiring without vLLM: every rank runs the ``LearnerService``; rank 0's ``WeightSync``
connects the learner's stage senders to the transfer groups of an engine of two fake vLLM workers
(``tests/weight_helpers.py``: the engine's own ``WeightTransfer``, megathunder's worker extension
on threads) and pushes three times -- the initial weights, then after each of two optimizer steps
-- exporting the HF directory after each push. Rank 0 saves, per push, whether each worker's reloaded tensors equal the export
(cast to the workers' dtype) bit for bit, and the push's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megathunder.config import CollectiveTransfer, GRPOObjective, LearnerConfig, LedgerConfig  # noqa: E402
from megathunder.learner.endpoint import LearnerEndpoint  # noqa: E402
from megathunder.learner.learner import MegatronLearner  # noqa: E402
from megathunder.learner.parallel import destroy_distributed, init_distributed  # noqa: E402
from megathunder.learner.safetensors_io import load_dir  # noqa: E402
from megathunder.learner.service import LearnerService  # noqa: E402
from megathunder.streaming import synthetic as syn  # noqa: E402
from megathunder.trainer.weight_sync import WeightSync  # noqa: E402
from megathunder.trajectory import batch_plan  # noqa: E402
from tests.weight_helpers import FakeEngine, FakeWorker  # noqa: E402


async def control(args, service: LearnerService[LearnerEndpoint], learner: MegatronLearner) -> dict:
    dtype = getattr(torch, args.dtype)
    workers = [FakeWorker(0, dtype), FakeWorker(1, dtype)]
    cfg = CollectiveTransfer(backend="gloo", bucket_mb=args.bucket_kb / 1024, sparse_threshold=args.sparse)
    engine = FakeEngine([workers], cfg)
    sync = WeightSync(engine, service, cfg, learner.pgs.dims.pp)  # type: ignore[arg-type]
    await sync.connect()
    pushes = []
    rng = random.Random(0)
    for push in range(3):
        if push:  # an optimizer step on a synthetic batch (batch-synchronous path)
            batch = syn.random_batch(rng, [4, 4], learner.model_cfg.vocab_size, 24, torch.float32, empty_prob=0.0)
            rewards = syn.random_rewards(rng, batch, "continuous")
            service.submit(LearnerEndpoint.begin, batch_plan(batch), False)
            for traj in batch:
                service.submit(LearnerEndpoint.finished, traj)
            for traj, r in zip(batch, rewards, strict=True):
                service.submit(LearnerEndpoint.reward, traj.traj_id, r)
            await service.call(LearnerEndpoint.close)
            await service.call(LearnerEndpoint.step)
        stats = await sync.push(push)
        export = Path(args.out).with_name(f"export{push}")
        await service.call(LearnerEndpoint.export, str(export))
        expected = {n: t.to(dtype) for n, t in load_dir(export).items()}
        pushes.append({
            "stats": stats,
            "names_equal": [sorted(w.loaded) == sorted(expected) for w in workers],
            "bit_exact": [all(torch.equal(w.loaded[n], t) for n, t in expected.items()) for w in workers],
        })
    await engine.close()
    return {"pushes": pushes, "events": engine.events}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--hf", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--bucket-kb", type=float, default=4.0)
    p.add_argument("--sparse", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--parallel", default="{}", help="JSON: more of learner.parallel (MoE: sequence / expert parallel)")
    args = p.parse_args()
    cfg = LearnerConfig.model_validate({
        "parallel": {"tensor_parallel": args.tp, "pipeline_parallel": args.pp, **json.loads(args.parallel)},
        "model": {"hf_checkpoint": args.hf},
        "optimizer": {"name": "adam", "lr": args.lr, "clip_grad": 0.0, "use_distributed_optimizer": False},
    })
    pgs = init_distributed(cfg)
    learner = MegatronLearner.build(cfg, GRPOObjective(), pgs, LedgerConfig())
    service = LearnerService(LearnerEndpoint(learner, Path(args.out).with_name("ckpt")), pgs.rank, pgs.world_size)
    if pgs.rank != 0:
        service.serve()
    else:
        try:
            result = asyncio.run(control(args, service, learner))
        finally:
            service.stop()
        torch.save(result, args.out)
    destroy_distributed()


if __name__ == "__main__":
    main()
