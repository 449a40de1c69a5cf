"""``megathunder bench probe``: how far vLLM's and the learner's logprobs differ on the same weights.

The zero-staleness probe (``megathunder.trainer.probe``) stops a run when a push leaves vLLM's
logprobs further from the learner's than numerics explain. This measures the numerics: a tiny
random Qwen2 (or ``--model``) in the Megatron learner and in an in-process vLLM engine, the weights
pushed as in training; ``--probes`` continuations of ``--tokens`` tokens each sampled at
``--temperature``, on the initial weights and after each of ``--updates`` pushed weight updates
(random perturbations of relative size ``--update-scale``), each compared the trainer's two ways
(vLLM's logprobs of its samples at T; the continuation scored in one prefill at T = 1). Per engine
dtype it reports the calibration floor as the trainer sets it (the max scored gap of the first
``--calibration`` continuations), their sampled gaps' max / floor (the trainer's temperature check
needs it under the margin), the largest gap / floor ratio of every later probe (scored, as every
push's probe is: the margin the tolerance needs), and the gap a push that did not happen leaves
(the next update's, unpushed).
Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch


async def _measure(model_dir: Path, engine_dtype: str, params_dtype: str, args: argparse.Namespace) -> dict:
    from megathunder.config import EngineConfig, GRPOObjective, LearnerConfig
    from megathunder.learner.learner import MegatronLearner
    from megathunder.learner.parallel import init_distributed
    from megathunder.learner.push import gather_to_rank0
    from megathunder.rollout.engines import start_engine
    from megathunder.rollout.types import SamplingParams
    from megathunder.trainer.probe import engine_probe, max_logprob_gap
    from megathunder.trajectory import Trajectory

    cfg = LearnerConfig.model_validate({"precision": {"params_dtype": params_dtype},
                                        "optimizer": {"name": "sgd", "use_distributed_optimizer": False}})
    learner = MegatronLearner.build(cfg, GRPOObjective(), init_distributed(cfg), hf_dir=model_dir,
                                    temperature=args.temperature)
    engine = await start_engine(EngineConfig(dtype=engine_dtype, max_model_len=512, enforce_eager=True,
                                             kv_cache_memory_bytes=64 * 2**20, weight_transfer={"kind": "rpc"}),
                                model_dir, log_dir=args.log_dir)  # one process: the gathered weights by rpc
    prompt = list(range(5, 45))

    def learner_logp(tokens: list[int], temperature: float) -> torch.Tensor:
        t = torch.tensor(tokens)
        mask = torch.zeros(t.numel() - 1, dtype=torch.bool)
        mask[len(prompt) - 1:] = True
        logp = learner.token_logprobs([Trajectory(-1, -1, t, mask)], temperature=temperature)
        assert logp is not None
        return logp[0][len(prompt) - 1:]

    async def probe(seed: int) -> tuple[float, float]:
        """The trainer's two ways on one continuation: vLLM's logprobs of its own samples at T
        (calibration's decode path), and the continuation scored in one prefill at T = 1 (a push's probe)."""
        out = await engine.generate(prompt, SamplingParams(max_new_tokens=args.tokens, temperature=args.temperature,
                                                           seed=seed, ignore_eos=True))
        sampled = max_logprob_gap(out.logprobs, learner_logp(prompt + list(out.token_ids), args.temperature))
        scored = await engine_probe(engine, prompt, out.token_ids, seed=seed)
        return sampled, max_logprob_gap(scored.logprobs, learner_logp(prompt + scored.tokens, 1.0))

    def full_weights() -> list[tuple[str, torch.Tensor]]:
        weights = gather_to_rank0(learner.model, learner.model_cfg, learner.pgs, learner.offset)
        assert weights is not None
        return weights

    def perturb(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in learner.model.parameters():
                p.add_(args.update_scale * p.detach().float().abs().mean() * torch.randn(p.shape, generator=g).to(p))

    try:
        version = 0
        await engine.update_weights(full_weights(), version)
        same = [await probe(seed) for seed in range(args.probes)]
        after, stale = [], []
        for update in range(args.updates):
            perturb(1000 + update)  # the learner moved; vLLM has not been pushed yet
            stale.append(await probe(5000 + update))
            version += 1
            await engine.update_weights(full_weights(), version)
            after += [await probe(10_000 * (update + 1) + seed) for seed in range(args.probes // 2)]
    finally:
        await engine.close()
    floor = max(scored for _, scored in same[: args.calibration])  # the trainer's floor
    pushes = [scored for _, scored in same[args.calibration:]]  # every later probe is scored in one prefill
    after_scored = [scored for _, scored in after]
    later = pushes + after_scored
    return {"engine_dtype": engine_dtype, "params_dtype": params_dtype, "floor": floor,
            "sampled_ratio": max(g for g, _ in same[: args.calibration]) / floor,  # the temperature check's
            "median_gap": float(torch.tensor([g for _, g in same]).median()),
            "max_ratio": max(later) / floor if later else 0.0,
            "max_ratio_same_weights": max(pushes) / floor if pushes else 0.0,
            "max_ratio_after_updates": max(after_scored) / floor if after_scored else 0.0,
            "min_stale_gap": min(g for _, g in stale) if stale else float("nan"),
            "num_probes": len(same) + len(after)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megathunder bench probe", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory (default: a tiny random Qwen2)")
    parser.add_argument("--engine-dtypes", default="float32,bfloat16")
    parser.add_argument("--params-dtype", default="float32", help="the learner's: float32 or bfloat16")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--probes", type=int, default=40)
    parser.add_argument("--calibration", type=int, default=3)
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--update-scale", type=float, default=1e-3, help="relative size of each weight update")
    args = parser.parse_args(argv)

    from megathunder.models.tiny_hf import save_tiny_qwen2

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else save_tiny_qwen2(Path(tmp) / "tiny")
        args.log_dir = Path(tmp) / "logs"
        for dtype in args.engine_dtypes.split(","):
            results.append(asyncio.run(_measure(model_dir, dtype, args.params_dtype, args)))
    print(f"\nprobe noise: learner {args.params_dtype}, {args.tokens} tokens per probe at T={args.temperature}, "
          f"calibration on {args.calibration} probes, updates of relative size {args.update_scale:g}")
    print(f"{'engine':<9} {'floor':>9} {'sampled':>8} {'median':>9} {'max ratio':>10} {'same w.':>8} "
          f"{'updated':>8} {'stale min':>10}")
    for r in results:
        print(f"{r['engine_dtype']:<9} {r['floor']:>9.2e} {r['sampled_ratio']:>8.2f} {r['median_gap']:>9.2e} "
              f"{r['max_ratio']:>10.2f} {r['max_ratio_same_weights']:>8.2f} {r['max_ratio_after_updates']:>8.2f} "
              f"{r['min_stale_gap']:>10.2e}")
    print(json.dumps({"bench": "probe", "rows": results}))
    return 0
