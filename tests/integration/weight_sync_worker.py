"""A learner (one process, or PP=2 under torchrun) with an in-process vLLM engine on rank 0: push
weights after a step, probe staleness -- the trainer's wiring (``LearnerService``, the stages'
senders joining the engine's transfer groups, ``StreamedWeights``) without the agent loop.

Run by tests/integration/test_weight_sync.py in its own process(es) (the learner installs Megatron's
process groups and the CPU compatibility layer, which must not leak into the test session).
Rank 0 prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


import torch  # noqa: E402

from megathunder.config import EngineConfig, GRPOObjective, LearnerConfig, LedgerConfig  # noqa: E402
from megathunder.learner.endpoint import LearnerEndpoint  # noqa: E402
from megathunder.learner.learner import MegatronLearner  # noqa: E402
from megathunder.learner.parallel import destroy_distributed, init_distributed  # noqa: E402
from megathunder.learner.service import LearnerService  # noqa: E402
from megathunder.models.tiny_hf import TinyModelSpec, save_tiny_qwen2  # noqa: E402
from megathunder.rollout.engines import start_engine  # noqa: E402
from megathunder.rollout.engines.transfer import StageSenders  # noqa: E402
from megathunder.rollout.types import RolloutEngine, SamplingParams, StreamedWeights  # noqa: E402
from megathunder.streaming import synthetic as syn  # noqa: E402
from megathunder.trainer.trainer import StaleWeightsError, max_logprob_gap  # noqa: E402
from megathunder.trajectory import batch_plan  # noqa: E402

Service = LearnerService[LearnerEndpoint]


async def push_weights(service: Service, engine: RolloutEngine, policy_version: int) -> dict:
    """The trainer's push: the stages stream their buckets while the engine is paused."""
    stats: dict = {}

    async def send() -> None:
        stats.update(await service.call(LearnerEndpoint.send_weights))

    await engine.update_weights(StreamedWeights(send), policy_version)
    return stats


async def probe_staleness(service: Service, engine: RolloutEngine, prompt: list[int], num_tokens: int,
                          tolerance: float, seed: int) -> float:
    """The trainer's probe: the engine samples, the learner scores the same tokens."""
    out = await engine.generate(prompt, SamplingParams(max_new_tokens=num_tokens, seed=seed, ignore_eos=True))
    learner_logp = await service.call(LearnerEndpoint.score, prompt + list(out.token_ids), len(prompt))
    gap = max_logprob_gap(out.logprobs, learner_logp)
    if gap > tolerance:
        raise StaleWeightsError(f"rollout engine logprobs differ from the learner's by {gap:.3e} (> {tolerance:.1e}) "
                                f"at policy version {engine.policy_version}")
    return gap


async def control(workdir: Path, model_dir: Path, service: Service, learner: MegatronLearner) -> dict:
    senders = StageSenders(learner.pgs.dims.pp, lambda rdv: service.call(LearnerEndpoint.join_weight_transfer, rdv))
    engine = await start_engine(
        EngineConfig(deployment="in_process", dtype="float32", max_model_len=512, enforce_eager=True,
                     gpu_memory_utilization=0.3, kv_cache_memory_bytes=128 * 2**20,
                     weight_transfer={"kind": "collective", "bucket_mb": 0.05}),
        model_dir, log_dir=workdir / "logs", senders=senders,
    )
    prompt = list(range(5, 45))
    out: dict = {}
    try:
        out["gap_initial"] = await probe_staleness(service, engine, prompt, 48, tolerance=1e-4, seed=1)

        rng = random.Random(0)
        batch = syn.random_batch(rng, [4, 4], learner.model_cfg.vocab_size, 64, torch.float32, empty_prob=0.0)
        rewards = syn.random_rewards(rng, batch, "continuous")
        service.submit(LearnerEndpoint.begin, batch_plan(batch), False)
        for traj in batch:
            service.submit(LearnerEndpoint.finished, traj)
        for traj, r in zip(batch, rewards, strict=True):
            service.submit(LearnerEndpoint.reward, traj.traj_id, r)
        await service.call(LearnerEndpoint.close)
        await service.call(LearnerEndpoint.step)

        try:  # the engine still holds the old weights: the probe must say so
            await probe_staleness(service, engine, prompt, 48, tolerance=1e-4, seed=2)
            out["stale_detected"] = False
        except StaleWeightsError as err:
            out["stale_detected"] = True
            out["stale_message"] = str(err)

        out["push"] = await push_weights(service, engine, policy_version=1)
        out["policy_version"] = engine.policy_version
        out["gap_after_sync"] = await probe_staleness(service, engine, prompt, 48, tolerance=1e-4, seed=3)
    finally:
        await engine.close()
    return out


def main(workdir: Path, pp: int) -> None:
    model_dir = workdir / "tiny"
    cfg = LearnerConfig.model_validate({
        "parallel": {"pipeline_parallel": pp},
        "model": {"hf_checkpoint": str(model_dir)},
        "optimizer": {"name": "sgd", "lr": 20.0, "clip_grad": 0.0, "use_distributed_optimizer": False},
    })
    pgs = init_distributed(cfg)
    if pgs.rank == 0:
        save_tiny_qwen2(model_dir, TinyModelSpec(num_layers=2 * pp))
    if pgs.world_size > 1:
        torch.distributed.barrier()
    learner = MegatronLearner.build(cfg, GRPOObjective(), pgs, LedgerConfig())
    service = LearnerService(LearnerEndpoint(learner, workdir / "ckpt"), pgs.rank, pgs.world_size)
    if pgs.rank != 0:
        service.serve()
    else:
        try:
            result = asyncio.run(control(workdir, model_dir, service, learner))
        finally:
            service.stop()
        print(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1)
