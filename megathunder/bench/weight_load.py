"""``megathunder bench load``: peak host memory per rank while loading a HF checkpoint at TP x PP.

Builds a random Qwen2 of the given shape (fp32, saved by transformers), then starts ``tp x pp``
ranks (torchrun, gloo) twice: each rank builds its GPTModel chunk and loads its weights with the
lazy reader (``hf.load_hf``: only its slices, ``safe_open(...).get_slice``) or, as the baseline, with
the whole checkpoint read into memory first (what every rank did before). Per rank: the process's
resident memory before the model exists (``baseline``), the model chunk's bytes (``shard``), the
largest HF tensor, and the kernel's peak resident set during the load (VmHWM, reset just before
it), reported as ``peak - baseline`` against ``shard + largest tensor``. Prints a table, then one
JSON object as the last line.

``--num-experts N`` builds a Qwen3-MoE instead (every layer N experts of width
``--moe-ffn-hidden-size``), loaded at TP x PP with ``--expert-parallel`` (and sequence parallelism
under TP): each rank reads only its E / EP experts of its stage, so its shard -- and its peak --
shrink with EP.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def build_checkpoint(out: Path, args: argparse.Namespace) -> Path:
    from megathunder.models.tiny_hf import TinyModelSpec, save_tiny_qwen2

    spec = TinyModelSpec(hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size,
                         num_layers=args.num_layers, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                         model_vocab_size=args.vocab_size, init_std=0.02, tie_word_embeddings=args.tie,
                         num_experts=args.num_experts, num_experts_per_tok=min(2, max(args.num_experts, 1)),
                         moe_intermediate_size=args.moe_ffn_hidden_size)
    return save_tiny_qwen2(out, spec)


def _rank(args: argparse.Namespace) -> None:
    """One rank: build the model chunk, load it (timed, peak measured), write its figures."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import torch

    from megathunder.bench.rss import peak_bytes, reset_peak, rss_bytes
    from megathunder.config import LearnerConfig
    from megathunder.learner import hf
    from megathunder.learner.model import build_gpt_model, layer_offset, resolve_model_config
    from megathunder.learner.parallel import destroy_distributed, init_distributed
    from megathunder.learner.safetensors_io import CheckpointReader

    moe = {"expert_parallel": args.expert_parallel, "sequence_parallel": args.tp > 1} if args.num_experts else {}
    cfg = LearnerConfig.model_validate({"parallel": {"tensor_parallel": args.tp, "pipeline_parallel": args.pp, **moe},
                                        "model": {"hf_checkpoint": args.hf}})
    pgs = init_distributed(cfg)
    model_cfg = resolve_model_config(cfg.model, args.hf)
    baseline = rss_bytes()
    model = build_gpt_model(model_cfg, cfg.precision, pgs)
    built = rss_bytes()
    reader = CheckpointReader(args.hf)
    largest = max(math.prod(reader.shape(n)) * 4 for n in reader.file_of)
    torch.distributed.barrier()
    reset_peak()
    t0 = time.perf_counter()
    # the baseline: the whole checkpoint in this rank's memory, as every rank held it before (copied:
    # a safetensors tensor is a view of the mmap'd file, resident only where touched)
    src = hf.InMemorySource({n: reader.read(n).clone() for n in reader.file_of}) if args.reader == "full" else None
    hf.load_hf(model, args.hf, model_cfg, pgs, layer_offset(model_cfg, pgs), src=src)
    seconds = time.perf_counter() - t0
    peak = peak_bytes()
    del src
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    out = {"rank": pgs.rank, "tp_rank": pgs.tp_rank, "pp_rank": pgs.pp_rank, "baseline": baseline,
           "built": built, "peak": peak, "shard": shard, "largest_tensor": largest, "load_s": seconds}
    Path(args.result_dir, f"rank{pgs.rank}.json").write_text(json.dumps(out))
    destroy_distributed()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: argparse.Namespace, hf_dir: Path, reader: str, result_dir: Path) -> list[dict]:
    result_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.tp * args.pp}",
           f"--master-port={_free_port()}", "--master-addr=127.0.0.1", "-m", "megathunder.bench.weight_load",
           "--rank-worker", "--hf", str(hf_dir), "--tp", str(args.tp), "--pp", str(args.pp),
           "--reader", reader, "--result-dir", str(result_dir), "--num-experts", str(args.num_experts),
           "--expert-parallel", str(args.expert_parallel)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"bench load ({reader}) failed:\n{proc.stderr[-4000:]}")
    return [json.loads(p.read_text()) for p in sorted(result_dir.glob("rank*.json"))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megathunder bench load", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--ffn-hidden-size", type=int, default=4096)
    parser.add_argument("--num-layers", type=int, default=16)
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--tie", action="store_true", help="tied input/output embeddings")
    parser.add_argument("--num-experts", type=int, default=0, help="> 0: a Qwen3-MoE with this many experts a layer")
    parser.add_argument("--moe-ffn-hidden-size", type=int, default=512, help="MoE: each expert's width")
    parser.add_argument("--expert-parallel", type=int, default=1, help="MoE: experts split over this many TP ranks")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--readers", default="lazy,full", help="comma-separated: lazy (ours), full (whole checkpoint)")
    parser.add_argument("--hf", help="an existing checkpoint instead of building one")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reader", default="lazy", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_worker:
        _rank(args)
        return 0

    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="mt_bench_load_") as tmp:
        hf_dir = Path(args.hf) if args.hf else build_checkpoint(Path(tmp) / "model", args)
        files = list(hf_dir.glob("*.safetensors"))
        model_bytes = sum(f.stat().st_size for f in files)
        for reader in (r.strip() for r in args.readers.split(",") if r.strip()):
            results[reader] = _launch(args, hf_dir, reader, Path(tmp) / reader)
    mib = 2**20
    print(f"\nloading a {model_bytes / mib:.0f} MiB fp32 checkpoint at TP {args.tp} x PP {args.pp} "
          f"({args.tp * args.pp} ranks); MiB per rank, peak during the load above the process before the model")
    print(f"{'reader':<6} {'rank':>4} {'shard':>7} {'largest':>7} {'peak-base':>9} {'ratio':>6} {'load_s':>7}")
    summary = {}
    for reader, ranks in results.items():
        ratios = []
        for r in ranks:
            above = r["peak"] - r["baseline"]
            ratio = above / (r["shard"] + r["largest_tensor"])
            ratios.append(ratio)
            print(f"{reader:<6} {r['rank']:>4} {r['shard'] / mib:>7.0f} {r['largest_tensor'] / mib:>7.0f} "
                  f"{above / mib:>9.0f} {ratio:>6.2f} {r['load_s']:>7.2f}")
        summary[reader] = {"max_ratio": round(max(ratios), 3),
                           "max_peak_above_baseline_mib": round(max(r["peak"] - r["baseline"] for r in ranks) / mib, 1),
                           "max_load_s": round(max(r["load_s"] for r in ranks), 2)}
    print(json.dumps({"model_mib": round(model_bytes / mib, 1), "tp": args.tp, "pp": args.pp,
                      "num_experts": args.num_experts, "ep": args.expert_parallel,
                      "shard_mib": round(max(r["shard"] for rs in results.values() for r in rs) / mib, 1),
                      "largest_tensor_mib": round(max(r["largest_tensor"] for rs in results.values() for r in rs) / mib, 1),
                      "readers": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
