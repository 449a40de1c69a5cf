"""``megathunder bench weights``: seconds per weight push into vLLM, RPC payload vs collective.

One in-process vLLM engine per transfer mode, one after the other, on a random Qwen2 of the given
shape (fp32). A push is ``update_weights`` from in-memory tensors: pause, load (serialised into
the ``collective_rpc`` payload, or bucketed broadcast over the gloo transfer group), reset the
prefix cache, stamp the version, resume. Median of ``repeats`` pushes after one warm-up push.
Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


async def _bench_mode(model_dir: Path, mode: str, bucket_mb: float, repeats: int, log_dir: Path) -> float:
    from safetensors.torch import load_file

    from megathunder.config import EngineConfig
    from megathunder.rollout.engines import start_engine

    cfg = EngineConfig(dtype="float32", max_model_len=256, enforce_eager=True, kv_cache_memory_bytes=64 * 2**20,
                       weight_transfer={"kind": "rpc"} if mode == "rpc" else {"kind": mode, "bucket_mb": bucket_mb})
    weights = load_file(next(model_dir.glob("*.safetensors")))
    engine = await start_engine(cfg, model_dir, log_dir=log_dir)
    try:
        times = []
        for version in range(1, repeats + 2):  # the first push warms up
            t0 = time.perf_counter()
            await engine.update_weights(iter(weights.items()), policy_version=version)
            times.append(time.perf_counter() - t0)
    finally:
        await engine.close()
    return statistics.median(times[1:])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megathunder bench weights", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--modes", default="rpc,collective", help="comma-separated: rpc,collective")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=3, help="timed pushes per mode (median)")
    args = parser.parse_args(argv)

    from megathunder.models.tiny_hf import TinyModelSpec, save_tiny_qwen2

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    spec = TinyModelSpec(hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                         num_layers=args.num_layers, num_heads=args.hidden_size // 32,
                         num_kv_heads=max(1, args.hidden_size // 64))
    results = {}
    with tempfile.TemporaryDirectory(prefix="mt_bench_weights_") as tmp:
        model_dir = save_tiny_qwen2(Path(tmp) / "model", spec)
        mib = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20
        for mode in (m.strip() for m in args.modes.split(",") if m.strip()):
            results[mode] = asyncio.run(_bench_mode(model_dir, mode, args.bucket_mb, args.repeats, Path(tmp) / mode))
    print(f"\nweight push, in-process vLLM, model {args.hidden_size} hidden x {args.num_layers} layers "
          f"({mib:.1f} MiB fp32), bucket {args.bucket_mb:g} MiB, median of {args.repeats}")
    for mode, seconds in results.items():
        print(f"{mode:<12} {seconds:>8.3f} s")
    print(json.dumps({"model_mib": round(mib, 2), "bucket_mb": args.bucket_mb,
                      "push_s": {m: round(s, 4) for m, s in results.items()}}))
    return 0
