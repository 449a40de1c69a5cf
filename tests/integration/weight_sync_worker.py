"""One learner process with an in-process vLLM engine (fp32 or bf16): the probe's noise floor on the
same weights, a step without a push caught, a push after it accepted.

Run by tests/integration/test_weight_sync.py in its own process (the learner installs Megatron's
process groups and the CPU compatibility layer, which must not leak into the test session).
Prints one JSON line.
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

from megathunder.config import EngineConfig, GRPOObjective, LearnerConfig, LedgerConfig, ScheduleConfig  # noqa: E402
from megathunder.learner.learner import MegatronLearner  # noqa: E402
from megathunder.learner.parallel import init_distributed  # noqa: E402
from megathunder.models.tiny_hf import save_tiny_qwen2  # noqa: E402
from megathunder.rollout.engines import start_engine  # noqa: E402
from megathunder.rollout.types import RolloutEngine, SamplingParams  # noqa: E402
from megathunder.streaming import synthetic as syn  # noqa: E402
from megathunder.trainer.probe import (  # noqa: E402
    PROBE_SEED,
    ProbeSample,
    ProbeTolerance,
    engine_kept_its_weights,
    max_logprob_gap,
)
from megathunder.trajectory import Trajectory, batch_plan  # noqa: E402


async def push_weights(learner: MegatronLearner, engine: RolloutEngine, policy_version: int) -> None:
    """The trainer's push on one process: gather + reshard, then load into the engine."""
    await engine.update_weights(learner.inference_weights(), policy_version)


async def probe(learner: MegatronLearner, engine: RolloutEngine, prompt: list[int], num_tokens: int,
                seed: int) -> ProbeSample:
    """The trainer's probe on one process: the engine samples, the learner scores the same tokens."""
    await engine.reset_prefix_cache()
    out = await engine.generate(prompt, SamplingParams(max_new_tokens=num_tokens, seed=seed, ignore_eos=True))
    tokens = torch.tensor(prompt + list(out.token_ids))
    mask = torch.zeros(tokens.numel() - 1, dtype=torch.bool)
    mask[len(prompt) - 1:] = True
    logp = learner.token_logprobs([Trajectory(-1, -1, tokens, mask)])
    assert logp is not None
    return ProbeSample(tuple(out.token_ids), tuple(out.logprobs), logp[0][len(prompt) - 1:])


def gap(sample: ProbeSample) -> float:
    return max_logprob_gap(sample.engine_logprobs, sample.learner_logprobs)


async def main(workdir: Path, engine_dtype: str) -> dict:

    model_dir = save_tiny_qwen2(workdir / "tiny")
    cfg = LearnerConfig.model_validate({
        "model": {"hf_checkpoint": str(model_dir)},
        "optimizer": {"name": "sgd", "lr": 1.0, "clip_grad": 0.0, "use_distributed_optimizer": False},
    })
    learner = MegatronLearner.build(cfg, GRPOObjective(), init_distributed(cfg), LedgerConfig())
    engine = await start_engine(
        EngineConfig(deployment="in_process", dtype=engine_dtype, max_model_len=512, enforce_eager=True,
                     gpu_memory_utilization=0.3, kv_cache_memory_bytes=128 * 2**20),
        model_dir, log_dir=workdir / "logs",
    )
    prompt = list(range(5, 45))
    out = {}
    tolerance = ProbeTolerance(minimum=1e-3, margin=ScheduleConfig().probe_noise_margin)  # the trainer's defaults
    try:
        gaps = [gap(await probe(learner, engine, prompt, 48, seed)) for seed in range(1, 4)]  # same weights
        tolerance.calibrate(gaps)
        out["gap_initial"], out["tolerance"] = max(gaps), tolerance.value
        before = await probe(learner, engine, prompt, 48, PROBE_SEED)

        rng = random.Random(0)
        vocab = learner.model_cfg.vocab_size
        batch = syn.random_batch(rng, [4, 4], vocab, 64, torch.float32, empty_prob=0.0)
        rewards = syn.random_rewards(rng, batch, "continuous")
        ledger = learner.ledger
        ledger.begin_batch(batch_plan(batch))
        syn.feed_events(ledger, batch, rewards, syn.random_event_order(rng, len(batch)))
        ledger.close_batch()
        learner.step()

        # the engine still holds the old weights: the probe must say so
        stale = await probe(learner, engine, prompt, 48, PROBE_SEED)
        out["gap_stale"] = gap(stale)
        out["stale_detected"] = engine_kept_its_weights(before, stale)

        await push_weights(learner, engine, policy_version=1)
        fresh = await probe(learner, engine, prompt, 48, PROBE_SEED)
        out["policy_version"] = engine.policy_version
        out["kept_after_sync"] = engine_kept_its_weights(before, fresh)
        out["gap_after_sync"] = gap(fresh)
    finally:
        await engine.close()
    return out


if __name__ == "__main__":
    result = asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
    print(json.dumps(result))
