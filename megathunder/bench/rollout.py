"""``megathunder bench rollout``: the rollout side's figures (BENCHMARKS.md).

Engine part: vLLM generation throughput per deployment (``megathunder.bench.rollout_engine``).
Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence


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

    from megathunder.bench.rollout_engine import run_engine_bench

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
