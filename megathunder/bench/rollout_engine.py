"""``megathunder bench rollout``: vLLM generation throughput per deployment (BENCHMARKS.md).

For each deployment (in-process ``AsyncLLM``; OpenAI-compatible servers behind the balancer) it
measures, on one engine at a time:

- startup: seconds until the engine answers;
- batch throughput: generated tokens/s with ``concurrency`` requests in flight (each exactly
  ``max_new_tokens`` long, ``ignore_eos``), the figure that matters for rollouts;
- single-request decode: tokens/s of one request alone (latency-bound);

(both the median of ``repeats`` runs: the machines are shared and a tiny model's runs are short)
- weight update: seconds for ``update_weights`` from in-memory tensors (pause, load, reset the
  prefix cache, resume).

Tokens/s counts generated tokens only; prompts are ``prompt_len`` random ids. Prints a table, then
one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from megathunder.config import EngineConfig
from megathunder.rollout.types import RolloutEngine, SamplingParams


@dataclass(frozen=True)
class EngineBenchResult:
    deployment: str
    num_servers: int
    startup_s: float
    batch_tokens_per_s: float
    batch_requests: int
    single_tokens_per_s: float
    weight_update_s: float

    def as_dict(self) -> dict:
        return asdict(self)


async def _timed_batch(
    engine: RolloutEngine, prompts: Sequence[Sequence[int]], params: SamplingParams
) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return time.perf_counter() - t0, sum(len(c.token_ids) for c in out)


async def bench_deployment(
    model_dir: Path,
    cfg: EngineConfig,
    *,
    concurrency: int,
    prompt_len: int,
    max_new_tokens: int,
    log_dir: Path,
    repeats: int = 3,
    seed: int = 0,
) -> EngineBenchResult:
    from safetensors.torch import load_file

    from megathunder.rollout.engines import start_engine

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(prompt_len)] for _ in range(concurrency)]
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, seed=seed)

    t0 = time.perf_counter()
    engine = await start_engine(cfg, model_dir, log_dir=log_dir)
    startup_s = time.perf_counter() - t0
    try:
        await _timed_batch(engine, prompts[:2], SamplingParams(max_new_tokens=8))  # warm-up
        batch = [await _timed_batch(engine, prompts, params) for _ in range(repeats)]
        single = [await _timed_batch(engine, prompts[:1], params) for _ in range(repeats)]
        weights = load_file(next(model_dir.glob("*.safetensors")))
        t0 = time.perf_counter()
        await engine.update_weights(iter(weights.items()), policy_version=1)
        update_s = time.perf_counter() - t0
    finally:
        await engine.close()
    return EngineBenchResult(
        deployment=cfg.deployment,
        num_servers=cfg.num_servers if cfg.deployment == "server" else 0,
        startup_s=round(startup_s, 2),
        batch_tokens_per_s=round(statistics.median(n / t for t, n in batch), 1),
        batch_requests=concurrency,
        single_tokens_per_s=round(statistics.median(n / t for t, n in single), 1),
        weight_update_s=round(update_s, 3),
    )


def run_engine_bench(
    deployments: list[str],
    *,
    model_dir: str | None,
    num_servers: int,
    concurrency: int,
    prompt_len: int,
    max_new_tokens: int,
    kv_cache_mib: int,
    base_port: int,
    repeats: int = 3,
) -> list[EngineBenchResult]:
    """One deployment after the other (never two engines at once on a small machine)."""
    from megathunder.models.tiny_hf import save_tiny_qwen2

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # a 3-17 s compile on CPU, not the engine's speed
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the figures readable
    with tempfile.TemporaryDirectory(prefix="mt_bench_rollout_") as tmp:
        model = Path(model_dir) if model_dir else save_tiny_qwen2(Path(tmp) / "tiny_qwen2")
        results = []
        for deployment in deployments:
            cfg = EngineConfig(
                deployment=deployment,
                dtype="float32",
                max_model_len=max(512, prompt_len + max_new_tokens),
                enforce_eager=True,
                gpu_memory_utilization=0.3,
                kv_cache_memory_bytes=kv_cache_mib * 2**20,
                num_servers=num_servers,
                base_port=base_port,
            )
            results.append(
                asyncio.run(
                    bench_deployment(
                        model,
                        cfg,
                        concurrency=concurrency,
                        prompt_len=prompt_len,
                        max_new_tokens=max_new_tokens,
                        log_dir=Path(tmp) / f"logs_{deployment}",
                        repeats=repeats,
                    )
                )
            )
        return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megathunder bench rollout", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--deployments", default="in_process,server", help="comma-separated: in_process,server"
    )
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: a tiny random Qwen2)")
    parser.add_argument("--num-servers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--base-port", type=int, default=18400)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median)")
    args = parser.parse_args(argv)

    deployments = [d.strip() for d in args.deployments.split(",") if d.strip()]
    results = run_engine_bench(
        deployments,
        model_dir=args.model,
        num_servers=args.num_servers,
        concurrency=args.concurrency,
        prompt_len=args.prompt_len,
        max_new_tokens=args.max_new_tokens,
        kv_cache_mib=args.kv_cache_mib,
        base_port=args.base_port,
        repeats=args.repeats,
    )
    print(
        f"\nvLLM engine, {args.concurrency} requests x {args.max_new_tokens} new tokens "
        f"(prompt {args.prompt_len} tokens), median of {args.repeats}"
    )
    print(f"{'deployment':<12} {'servers':>7} {'startup s':>10} {'batch tok/s':>12} {'single tok/s':>13} {'update s':>9}")
    for r in results:
        print(
            f"{r.deployment:<12} {r.num_servers:>7} {r.startup_s:>10.1f} {r.batch_tokens_per_s:>12.0f} "
            f"{r.single_tokens_per_s:>13.0f} {r.weight_update_s:>9.3f}"
        )
    print(json.dumps({"engine": [r.as_dict() for r in results]}))
    return 0
