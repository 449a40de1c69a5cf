"""A learner (one process, or PP=2 under torchrun) with an in-process vLLM engine on rank 0: push
weights after a step, probe staleness -- the trainer's wiring (``LearnerService``, ``WeightSync``:
the stages' senders joining the engine's transfer groups, then streaming into them) without the
agent loop. The
probe's noise floor is calibrated on the same weights (fp32 or bf16 engine), a step without a push is
caught (vLLM repeats the previous probe bit for bit), a push after it is accepted.

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

from megathunder.config import EngineConfig, GRPOObjective, LearnerConfig, LedgerConfig, ProbeConfig  # noqa: E402
from megathunder.learner.endpoint import LearnerEndpoint  # noqa: E402
from megathunder.learner.learner import MegatronLearner  # noqa: E402
from megathunder.learner.parallel import destroy_distributed, init_distributed  # noqa: E402
from megathunder.learner.service import LearnerService  # noqa: E402
from megathunder.models.tiny_hf import TinyModelSpec, save_tiny_qwen2  # noqa: E402
from megathunder.rollout.engines import start_engine  # noqa: E402
from megathunder.rollout.types import RolloutEngine, SamplingParams  # noqa: E402
from megathunder.streaming import synthetic as syn  # noqa: E402
from megathunder.trainer.probe import (  # noqa: E402
    PROBE_SEED,
    ProbeSample,
    ProbeTolerance,
    engine_kept_its_weights,
    engine_probe,
    max_logprob_gap,
)
from megathunder.trainer.weight_sync import WeightSync  # noqa: E402
from megathunder.trajectory import batch_plan  # noqa: E402

Service = LearnerService[LearnerEndpoint]


async def probe(service: Service, engine: RolloutEngine, prompt: list[int], continuation: list[int]) -> ProbeSample:
    """The trainer's probe: vLLM scores prompt + continuation in one prefill and samples one token
    after it, the learner scores the same tokens (both at temperature 1)."""
    out = await engine_probe(engine, prompt, continuation)
    learner_logp = await service.call(LearnerEndpoint.score, prompt + out.tokens, len(prompt), None, 1.0)
    return ProbeSample(tuple(out.tokens), tuple(out.logprobs), learner_logp)


async def draw(engine: RolloutEngine, prompt: list[int], seed: int) -> list[int]:
    """A continuation to probe with: 48 tokens vLLM samples after the prompt."""
    return (await engine.generate(prompt, SamplingParams(max_new_tokens=48, seed=seed, ignore_eos=True))).token_ids


def gap(sample: ProbeSample) -> float:
    return max_logprob_gap(sample.engine_logprobs, sample.learner_logprobs)


async def control(workdir: Path, model_dir: Path, service: Service, learner: MegatronLearner, engine_dtype: str) -> dict:
    cfg = EngineConfig(deployment="in_process", dtype=engine_dtype, max_model_len=512, enforce_eager=True,
                       gpu_memory_utilization=0.3, kv_cache_memory_bytes=128 * 2**20,
                       weight_transfer={"kind": "collective", "bucket_mb": 0.05})
    engine = await start_engine(cfg, model_dir, log_dir=workdir / "logs", senders="learner")
    sync = WeightSync(engine, service, cfg.weight_transfer, learner.pgs.dims.pp)  # the trainer's push
    prompt = list(range(5, 45))
    out: dict = {}
    try:
        await sync.connect()
        tolerance = ProbeTolerance(minimum=1e-3, margin=ProbeConfig().noise_margin)  # the trainer's defaults
        gaps = [gap(await probe(service, engine, prompt, await draw(engine, prompt, seed))) for seed in range(1, 4)]
        tolerance.calibrate(gaps)  # same weights
        out["gap_initial"], out["tolerance"] = max(gaps), tolerance.value
        continuation = await draw(engine, prompt, PROBE_SEED)
        before = await probe(service, engine, prompt, continuation)

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

        stale = await probe(service, engine, prompt, continuation)  # the engine still holds the old weights
        out["gap_stale"] = gap(stale)
        out["stale_detected"] = engine_kept_its_weights(before, stale)

        out["push"] = await sync.push(1)  # the stages stream their buckets while the engine is paused
        fresh = await probe(service, engine, prompt, continuation)
        out["policy_version"] = engine.policy_version
        out["kept_after_sync"] = engine_kept_its_weights(before, fresh)
        out["gap_after_sync"] = gap(fresh)
    finally:
        await engine.close()
    return out


def main(workdir: Path, pp: int, engine_dtype: str, tied: bool, experts: int = 0, parallel: dict | None = None) -> None:
    """``experts`` > 0: a tiny Qwen3-MoE with that many experts; ``parallel``: more of the learner's
    layout (e.g. TP=2 with SP and expert parallelism)."""
    model_dir = workdir / "tiny"
    cfg = LearnerConfig.model_validate({
        "parallel": {"pipeline_parallel": pp, **(parallel or {})},
        "model": {"hf_checkpoint": str(model_dir)},
        "optimizer": {"name": "sgd", "lr": 1.0, "clip_grad": 0.0, "use_distributed_optimizer": False},
    })
    pgs = init_distributed(cfg)
    if pgs.rank == 0:
        save_tiny_qwen2(model_dir, TinyModelSpec(num_layers=2 * pp, tie_word_embeddings=tied, num_experts=experts))
    if pgs.world_size > 1:
        torch.distributed.barrier()
    learner = MegatronLearner.build(cfg, GRPOObjective(), pgs, LedgerConfig())
    service = LearnerService(LearnerEndpoint(learner, workdir / "ckpt"), pgs.rank, pgs.world_size)
    if pgs.rank != 0:
        service.serve()
    else:
        try:
            result = asyncio.run(control(workdir, model_dir, service, learner, engine_dtype))
        finally:
            service.stop()
        print(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "tied",
         int(sys.argv[5]) if len(sys.argv) > 5 else 0, json.loads(sys.argv[6]) if len(sys.argv) > 6 else None)
