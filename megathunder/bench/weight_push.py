"""``megathunder bench weights``: seconds, bytes and memory of a weight push into vLLM.

Two sources:

- ``--source memory`` (default): one in-process vLLM engine per transfer mode, one after the other,
  on a random Qwen2 of the given shape (fp32); a push is ``update_weights`` from tensors in this
  process -- serialised into the ``collective_rpc`` payload (``rpc``), or framed buckets over the
  engine's own gloo group (``collective``). Median of ``repeats`` pushes after one warm-up push.
- ``--source learner``: the training path. ``tp x pp`` learner ranks (torchrun, gloo) load the same
  checkpoint; rank 0 starts the engine (``--deployments``: in-process, and/or ``--num-servers``
  local vLLM servers) with the learner's stage senders, and each push is the trainer's: every
  stage streams its buckets, cast to the engine's dtype (``collective``), or rank 0 gathers the
  model and sends it by RPC (``--modes rpc``). Between pushes every weight moves by ``--step``
  times a random sign (an Adam step at that learning rate moves weights by about ``lr``), so
  ``--sparse-threshold`` shows what sparse patches send. Per push: seconds (``update_weights``:
  pause, transfer, vLLM's reload, prefix-cache reset, resume), bytes, each rank's peak extra memory
  (kernel VmHWM above the resident set before the push); once: the gloo bandwidth between two
  learner processes, and the wire-time bound ``bytes x receivers / bandwidth`` (gloo's broadcast
  sends the payload to each receiver from the root).

Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _engine_cfg(deployment: str, mode: str, args: argparse.Namespace):
    from megathunder.config import EngineConfig

    transfer: dict[str, Any] = {"kind": "rpc"} if mode == "rpc" else {
        "kind": "collective", "backend": "gloo", "bucket_mb": args.bucket_mb, "sparse_threshold": args.sparse_threshold}
    return EngineConfig(deployment=deployment, dtype=args.dtype, max_model_len=256, enforce_eager=True,
                        kv_cache_memory_bytes=64 * 2**20, num_servers=args.num_servers, base_port=args.base_port,
                        weight_transfer=transfer)


# ---------------------------------------------------------------------- tensors in this process


async def _bench_memory(model_dir: Path, mode: str, args: argparse.Namespace, log_dir: Path) -> float:
    from megathunder.learner.safetensors_io import load_dir
    from megathunder.rollout.engines import start_engine

    weights = load_dir(model_dir)
    engine = await start_engine(_engine_cfg("in_process", mode, args), model_dir, log_dir=log_dir)
    try:
        times = []
        for version in range(1, args.repeats + 2):  # the first push warms up
            t0 = time.perf_counter()
            await engine.update_weights(iter(weights.items()), policy_version=version)
            times.append(time.perf_counter() - t0)
    finally:
        await engine.close()
    return statistics.median(times[1:])


# ---------------------------------------------------------------------- the learner's ranks


class BenchEndpoint:
    """What the bench's learner ranks do, called in lockstep through ``LearnerService``."""

    def __init__(self, model, model_cfg, pgs, offset: int) -> None:
        from megathunder.learner.push import StageSender

        self.model, self.model_cfg, self.pgs, self.offset = model, model_cfg, pgs, offset
        self.sender = StageSender(model, model_cfg, pgs, offset)
        self._mark = 0

    def join_weight_transfer(self, rendezvous_json: str) -> None:
        self.sender.join(rendezvous_json)

    def send_weights(self) -> dict[str, float]:
        return self.sender.send()

    def gather_weights(self):
        from megathunder.learner.push import gather_to_rank0

        return gather_to_rank0(self.model, self.model_cfg, self.pgs, self.offset)

    def mark_memory(self) -> None:
        """Every rank: the peak from now on starts at the current resident set."""
        from megathunder.bench.rss import reset_peak, rss_bytes

        self._mark = rss_bytes()
        reset_peak()

    def peak_extra_memory(self) -> list[int]:
        """Every rank's peak above its mark, gathered (rank order)."""
        import torch.distributed as dist

        from megathunder.bench.rss import peak_bytes

        mine = peak_bytes() - self._mark
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, mine)
        return out

    def step(self, size: float, seed: int) -> None:
        """Every weight += size * a random sign (a stand-in for an optimizer step)."""
        import torch

        g = torch.Generator().manual_seed(seed * 1000 + self.pgs.rank)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randint(0, 2, p.shape, generator=g, dtype=p.dtype).mul_(2).sub_(1), alpha=size)

    def link_bandwidth(self, nbytes: int, repeats: int = 3) -> float:
        """Bytes per second of a gloo broadcast from rank 0 to rank 1 (best of ``repeats``); a
        one-rank learner measures it between two processes of its own."""
        import torch.distributed as dist

        if dist.get_world_size() < 2:
            return _two_process_bandwidth(nbytes, repeats)
        group = dist.new_group([0, 1], backend="gloo")
        best = _timed_broadcasts(group, nbytes, repeats) if self.pgs.rank in (0, 1) else float("inf")
        box = [nbytes / best if best != float("inf") else 0.0]
        dist.broadcast_object_list(box, src=0)
        return float(box[0])


def _timed_broadcasts(group, nbytes: int, repeats: int) -> float:
    """The fastest of ``repeats`` broadcasts of ``nbytes`` from the group's first rank (seconds)."""
    import torch
    import torch.distributed as dist

    flat = torch.empty(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.broadcast(flat, src=dist.get_global_rank(group, 0), group=group)
        best = min(best, time.perf_counter() - t0)
    return best


def _bandwidth_rank(rank: int, store_path: str, nbytes: int, repeats: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        best = _timed_broadcasts(dist.group.WORLD, nbytes, repeats)
        if rank == 0:
            out.put(nbytes / best)
    finally:
        dist.destroy_process_group()


def _two_process_bandwidth(nbytes: int, repeats: int) -> float:
    """The gloo link between two fresh processes on this host (a one-rank learner has no peer)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="mt_bw_") as tmp:
        procs = [ctx.Process(target=_bandwidth_rank, args=(r, f"{tmp}/store", nbytes, repeats, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        try:
            return float(out.get(timeout=120))
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()


def _rank(args: argparse.Namespace) -> None:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from megathunder.config import LearnerConfig
    from megathunder.learner import hf
    from megathunder.learner.model import build_gpt_model, layer_offset, resolve_model_config
    from megathunder.learner.parallel import destroy_distributed, init_distributed
    from megathunder.learner.service import LearnerService

    cfg = LearnerConfig.model_validate({"parallel": {"tensor_parallel": args.tp, "pipeline_parallel": args.pp},
                                        "model": {"hf_checkpoint": args.hf}})
    pgs = init_distributed(cfg)
    model_cfg = resolve_model_config(cfg.model, args.hf)
    model = build_gpt_model(model_cfg, cfg.precision, pgs)
    offset = layer_offset(model_cfg, pgs)
    hf.load_hf(model, args.hf, model_cfg, pgs, offset)
    service = LearnerService(BenchEndpoint(model, model_cfg, pgs, offset), pgs.rank, pgs.world_size)
    if pgs.rank != 0:
        service.serve()
    else:
        try:
            result = asyncio.run(_control(args, service))
        finally:
            service.stop()
        Path(args.result).write_text(json.dumps(result))
    destroy_distributed()


async def _control(args: argparse.Namespace, service) -> dict:
    from megathunder.rollout.engines import start_engine
    from megathunder.trainer.weight_sync import WeightSync

    bandwidth = await service.call(BenchEndpoint.link_bandwidth, int(args.bucket_mb * 2**20))
    out: dict[str, Any] = {"link_bytes_per_s": bandwidth, "runs": {}}
    for deployment in (d.strip() for d in args.deployments.split(",") if d.strip()):
        for mode in (m.strip() for m in args.modes.split(",") if m.strip()):
            cfg = _engine_cfg(deployment, mode, args)
            engine = await start_engine(cfg, args.hf, log_dir=Path(args.result).with_name(f"logs_{deployment}"),
                                        senders="learner")
            sync = WeightSync(engine, service, cfg.weight_transfer, args.pp, endpoint=BenchEndpoint)
            pushes = []
            try:
                await sync.connect()  # each stage's sender joins the engine's groups (collective)
                for version in range(1, args.repeats + 2):  # the first push warms up (and is always dense)
                    if version > 1:
                        await service.call(BenchEndpoint.step, args.step, version)
                    stats: dict[str, float] = {}
                    await service.call(BenchEndpoint.mark_memory)
                    t0 = time.perf_counter()
                    if mode == "collective":
                        stats.update(await sync.push(version))  # the trainer's push
                    else:
                        weights = await service.call(BenchEndpoint.gather_weights)
                        raw = sum(t.numel() * t.element_size() for _, t in weights)
                        stats.update(payload_bytes=4 * -(-raw // 3), dense_bytes=raw)  # base64 of the tensors
                        await engine.update_weights(weights, version)
                        del weights
                    seconds = time.perf_counter() - t0
                    peaks = await service.call(BenchEndpoint.peak_extra_memory)
                    transfer = getattr(engine, "transfer", None)
                    received = transfer.last_received if transfer is not None else {}
                    pushes.append({"push_s": seconds, "peak_extra": peaks, **stats,
                                   "worker_total_s": received.get("total_s", float("nan")),
                                   "worker_wait_s": received.get("wait_s", float("nan"))})
            finally:
                await engine.close()
            workers = args.num_servers if deployment == "server" else 1
            out["runs"][f"{deployment}/{mode}"] = {"receivers": workers, "pushes": pushes}
    return out


def _launch_learner(args: argparse.Namespace, hf_dir: Path, tmp: Path) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = tmp / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.tp * args.pp}",
           f"--master-port={port}", "--master-addr=127.0.0.1", "-m", "megathunder.bench.weight_push",
           "--rank-worker", "--result", str(result), "--hf", str(hf_dir), *args.passthrough]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", VLLM_LOGGING_LEVEL="WARNING")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"bench weights (learner) failed:\n{proc.stderr[-6000:]}")
    return json.loads(result.read_text())


def _report_learner(args: argparse.Namespace, result: dict, model_mib: float) -> dict:
    mib = 2**20
    bw = result["link_bytes_per_s"]
    print(f"\nweight push from a TP {args.tp} x PP {args.pp} learner ({model_mib:.0f} MiB fp32 checkpoint) into "
          f"vLLM ({args.dtype}), bucket {args.bucket_mb:g} MiB, step {args.step:g}, sparse_threshold "
          f"{args.sparse_threshold:g}; gloo link {bw / mib:.0f} MiB/s; medians of {args.repeats} pushes after a warm-up")
    print(f"{'run':<22} {'push_s':>7} {'vllm_s':>7} {'MiB sent':>8} {'bound_s':>7} {'ratio':>6} {'changed':>7} "
          f"{'peak extra MiB per rank (max over pushes)':>40}")
    summary = {}
    for name, run in result["runs"].items():
        timed = run["pushes"][1:] or run["pushes"]
        push_s = statistics.median(p["push_s"] for p in timed)
        sent = statistics.median(p.get("payload_bytes", float("nan")) for p in timed)
        bound = sent * run["receivers"] / bw if sent == sent else float("nan")
        changed = statistics.median(p.get("changed_fraction", float("nan")) for p in timed)
        # the worker's own work (vLLM's reload: copies, oneDNN repacking), not waiting on the wire
        vllm_s = statistics.median(p["worker_total_s"] - p["worker_wait_s"] for p in timed)
        peaks = [max(p["peak_extra"][r] for p in run["pushes"]) / mib for r in range(len(run["pushes"][0]["peak_extra"]))]
        print(f"{name:<22} {push_s:>7.3f} {vllm_s:>7.3f} {sent / mib:>8.1f} {bound:>7.3f} {push_s / bound:>6.2f} {changed:>7.3f} "
              f"{' '.join(f'{x:.0f}' for x in peaks):>40}")
        summary[name] = {"push_s": round(push_s, 4), "vllm_reload_work_s": round(vllm_s, 4),
                         "push_minus_reload_work_s": round(push_s - vllm_s, 4), "sent_mib": round(sent / mib, 2), "wire_bound_s": round(bound, 4),
                         "ratio_to_bound": round(push_s / bound, 2), "changed_fraction": round(changed, 4),
                         "first_push_s": round(run["pushes"][0]["push_s"], 4),
                         "dense_mib": round(statistics.median(p.get("dense_bytes", float("nan")) for p in timed) / mib, 2),
                         "peak_extra_mib_per_rank": [round(x, 1) for x in peaks]}
    return {"link_mib_per_s": round(bw / mib, 1), "runs": summary}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megathunder bench weights", description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=["memory", "learner"], default="memory")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--ffn-hidden-size", type=int, help="default: 2 x hidden size")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, help="default: hidden size / 32")
    parser.add_argument("--num-kv-heads", type=int, help="default: hidden size / 64")
    parser.add_argument("--vocab-size", type=int, help="the model's vocabulary (default: the tiny tokenizer's)")
    parser.add_argument("--tie", action="store_true", help="tied input/output embeddings")
    parser.add_argument("--modes", default="rpc,collective", help="comma-separated: rpc,collective")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=3, help="timed pushes per mode (median)")
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (learner source: what is sent)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--deployments", default="in_process", help="learner source: in_process,server")
    parser.add_argument("--num-servers", type=int, default=2)
    parser.add_argument("--base-port", type=int, default=18600)
    parser.add_argument("--step", type=float, default=1e-5, help="learner source: weight change between pushes")
    parser.add_argument("--sparse-threshold", type=float, default=0.0)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--hf", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_worker:
        _rank(args)
        return 0

    from megathunder.models.tiny_hf import TinyModelSpec, save_tiny_qwen2

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    spec = TinyModelSpec(hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size or 2 * args.hidden_size,
                         num_layers=args.num_layers, num_heads=args.num_heads or args.hidden_size // 32,
                         num_kv_heads=args.num_kv_heads or max(1, args.hidden_size // 64),
                         model_vocab_size=args.vocab_size, tie_word_embeddings=args.tie,
                         init_std=0.02 if args.source == "learner" else TinyModelSpec.init_std)
    with tempfile.TemporaryDirectory(prefix="mt_bench_weights_") as tmp:
        model_dir = save_tiny_qwen2(Path(tmp) / "model", spec)
        mib = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20
        if args.source == "learner":
            keep = ["--tp", "--pp", "--modes", "--bucket-mb", "--repeats", "--dtype", "--deployments",
                    "--num-servers", "--base-port", "--step", "--sparse-threshold"]
            args.passthrough = [x for k in keep for x in (k, str(getattr(args, k[2:].replace("-", "_"))))]
            summary = _report_learner(args, _launch_learner(args, model_dir, Path(tmp)), mib)
            print(json.dumps({"model_mib": round(mib, 2), "tp": args.tp, "pp": args.pp, "bucket_mb": args.bucket_mb,
                              "dtype": args.dtype, **summary}))
            return 0
        results = {}
        for mode in (m.strip() for m in args.modes.split(",") if m.strip()):
            results[mode] = asyncio.run(_bench_memory(model_dir, mode, args, Path(tmp) / mode))
    print(f"\nweight push, in-process vLLM, model {args.hidden_size} hidden x {args.num_layers} layers "
          f"({mib:.1f} MiB fp32), bucket {args.bucket_mb:g} MiB, median of {args.repeats}")
    for mode, seconds in results.items():
        print(f"{mode:<12} {seconds:>8.3f} s")
    print(json.dumps({"model_mib": round(mib, 2), "bucket_mb": args.bucket_mb,
                      "push_s": {m: round(s, 4) for m, s in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
