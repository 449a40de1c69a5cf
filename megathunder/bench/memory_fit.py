"""``megathunder bench memory``: ``megathunder plan``'s per-rank prediction against the measured peak.

Each layout (TP / PP / DP, K and slot dtype / placement, recompute, attention kind, trajectory
length) runs as real learner ranks under torchrun (gloo): a Megatron learner with random weights
takes one thunder step of a batch that keeps every slot busy at once -- groups of 3 trajectories (3
per DP rank) of ``agent.max_total_tokens`` tokens, all finished first, then their rewards in the
worst order for memory (``reward_order``: every slot's S_g and R_g live, 2K + 1 buffers, while a
slotless group's trajectories run in one pipelined schedule call) -- then an optimizer step; then the
same batch once more with every event held and released at once (ready-work packing's largest call:
all the rank's trajectories in one schedule call, packed ``learner.pack_tokens`` to a micro-batch)
while the first batch's slots stay allocated (the pool reuses its buffers, it never frees them),
and a second optimizer step. One earlier tiny step has created the optimizer state, so the peak is
the steady state's.

What is measured on CPU (``--device cpu``): each rank's peak resident set (VmHWM, reset through
``/proc/self/clear_refs`` after the warm-up step) minus its baseline, the resident set (psutil) after
``import megatron`` and ``init_distributed`` but before the model exists: torch, megatron-core,
gloo, the Python heap -- the process's fixed cost, which the plan does not count. glibc's mmap
threshold is fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``) so that freed tensors go back to the OS and
the resident set follows the live tensors (the CPU analogue of CUDA's max allocated bytes).
On a GPU (``--device cuda``, one process: ``tools/gpu_check.sh``) the measure is
``torch.cuda.max_memory_allocated`` after a reset at the same point.

The prediction is ``megathunder.plan.memory_plan.plan``'s per-rank total for the same config and
world, without the weight push (not exercised here) and the process baseline. Prints a table and
a JSON last line; exit 1 if a layout is off by more than ``--tolerance`` (default 15%).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

A = ["learner.model.vocab_size=32000", "learner.model.hidden_size=768", "learner.model.ffn_hidden_size=2048",
     "learner.model.num_layers=8", "learner.model.num_attention_heads=12", "learner.model.num_query_groups=4",
     "learner.model.tie_word_embeddings=false"]  # 99.5M parameters
B = ["learner.model.vocab_size=8192", "learner.model.hidden_size=512", "learner.model.ffn_hidden_size=1408",
     "learner.model.num_layers=4", "learner.model.num_attention_heads=8", "learner.model.num_query_groups=2",
     "learner.model.tie_word_embeddings=false"]  # 19.7M parameters, long trajectories
C = ["learner.model.vocab_size=32000", "learner.model.hidden_size=1024", "learner.model.ffn_hidden_size=2816",
     "learner.model.num_layers=16", "learner.model.num_attention_heads=16", "learner.model.num_query_groups=4",
     "learner.model.tie_word_embeddings=false"]  # 246M parameters
COMMON = ["schedule.mode=thunder", "batch.samples_per_prompt=3", "learner.optimizer.name=adam",
          "learner.optimizer.use_distributed_optimizer=false", "agent.max_new_tokens_per_turn=1"]

BF16 = ["learner.precision.params_dtype=bfloat16"]
G = ["learner.model.vocab_size=65536", "learner.model.hidden_size=2048", "learner.model.ffn_hidden_size=5632",
     "learner.model.num_layers=16", "learner.model.num_attention_heads=16", "learner.model.num_query_groups=4",
     "learner.model.tie_word_embeddings=false"]  # 1.02B parameters (one GPU)
GPU_LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "G bf16 K2 fp32 s2048": (1, G + BF16 + ["batch.num_prompts_per_batch=2", "ledger.max_group_slots=2",
                                           "agent.max_total_tokens=2048"]),
    "G bf16 K4 bf16-slots s2048": (1, G + BF16 + ["batch.num_prompts_per_batch=4", "ledger.max_group_slots=4",
                                                 "ledger.slot_dtype=bfloat16", "agent.max_total_tokens=2048"]),
    "G bf16 K4 host-slots s2048": (1, G + BF16 + ["batch.num_prompts_per_batch=4", "ledger.max_group_slots=4",
                                                 "ledger.slot_placement=host", "agent.max_total_tokens=2048"]),
    "G bf16 unfused selective s8192": (1, G + BF16 + ["learner.precision.core_attention=megatron",
                                                     "batch.num_prompts_per_batch=1", "ledger.max_group_slots=1",
                                                     "learner.activations.recompute=selective",
                                                     "agent.max_total_tokens=8192"]),
    "G bf16 sdpa full-recompute s32768": (1, G + BF16 + ["learner.precision.core_attention=sdpa",
                                                        "learner.activations.recompute=full",
                                                        "batch.num_prompts_per_batch=1", "ledger.max_group_slots=1",
                                                        "agent.max_total_tokens=32768"]),
    "G bf16 TE s8192": (1, G + BF16 + ["learner.precision.layer_spec=transformer_engine", "batch.num_prompts_per_batch=1",
                                      "ledger.max_group_slots=1", "agent.max_total_tokens=8192"]),
}

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    # name: (ranks, overrides)
    "A tp1 K2 fp32 s512": (1, A + ["batch.num_prompts_per_batch=2", "ledger.max_group_slots=2",
                                   "agent.max_total_tokens=512"]),
    "A tp2 K4 bf16 s512": (2, A + ["learner.parallel.tensor_parallel=2", "batch.num_prompts_per_batch=4",
                                   "ledger.max_group_slots=4", "ledger.slot_dtype=bfloat16",
                                   "agent.max_total_tokens=512"]),
    "A pp2 K1 s512 (2 groups)": (2, A + ["learner.parallel.pipeline_parallel=2", "batch.num_prompts_per_batch=2",
                                         "ledger.max_group_slots=1", "agent.max_total_tokens=512"]),
    "A dp2 dist-opt K1 host s512": (2, A + ["batch.num_prompts_per_batch=1", "batch.samples_per_prompt=6",
                                            "ledger.max_group_slots=1",
                                            "ledger.slot_placement=host", "agent.max_total_tokens=512",
                                            "learner.optimizer.use_distributed_optimizer=true"]),
    "C tp2 K1 bf16 dist-opt s1024": (2, C + ["learner.parallel.tensor_parallel=2", "batch.num_prompts_per_batch=1",
                                             "ledger.max_group_slots=1", "ledger.slot_dtype=bfloat16",
                                             "agent.max_total_tokens=1024",
                                             "learner.optimizer.use_distributed_optimizer=true"]),
    "B tp1 K1 unfused s4096": (1, B + ["learner.precision.core_attention=megatron",
                                       "batch.num_prompts_per_batch=1", "ledger.max_group_slots=1",
                                       "agent.max_total_tokens=4096"]),
    "B tp2 K1 unfused selective s4096": (2, B + ["learner.precision.core_attention=megatron",
                                                 "learner.parallel.tensor_parallel=2", "batch.num_prompts_per_batch=1",
                                                 "ledger.max_group_slots=1", "agent.max_total_tokens=4096",
                                                 "learner.activations.recompute=selective"]),
    "B tp2 SP sdpa K1 s8192": (2, B + ["learner.parallel.tensor_parallel=2", "learner.parallel.sequence_parallel=true",
                                       "learner.precision.core_attention=sdpa", "batch.num_prompts_per_batch=1",
                                       "ledger.max_group_slots=1", "agent.max_total_tokens=8192"]),
    "B tp1 sdpa full-recompute K1 s8192": (1, B + ["learner.precision.core_attention=sdpa",
                                                   "learner.activations.recompute=full", "batch.num_prompts_per_batch=1",
                                                   "ledger.max_group_slots=1", "agent.max_total_tokens=8192"]),
}


# ---------------------------------------------------------------------- one rank


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _batch(cfg, vocab: int):
    import torch

    from megathunder.trajectory import Trajectory

    s = cfg.agent.max_total_tokens
    gen = torch.Generator().manual_seed(0)
    batch, rewards = [], []
    for g in range(cfg.batch.num_prompts_per_batch):
        for k in range(cfg.batch.samples_per_prompt):
            tid = g * cfg.batch.samples_per_prompt + k
            mask = torch.ones(s - 1, dtype=torch.bool)
            mask[:8] = False
            batch.append(Trajectory(tid, g, torch.randint(0, vocab, (s,), generator=gen), mask))
            rewards.append(k / cfg.batch.samples_per_prompt)  # distinct within a group
    return batch, rewards


def reward_order(cfg, num_trajs: int) -> list[int]:
    """The worst case for memory: the first K groups (those that get a slot) receive all rewards
    but their last, round robin, so every slot holds S_g and R_g on every DP rank; then every
    other group closes whole -- its trajectories released at once, one schedule call, pipelined
    under PP -- while the slots are full; then the slot groups close."""
    size = cfg.batch.samples_per_prompt
    groups = num_trajs // size
    k = cfg.ledger.max_group_slots
    slotted = range(min(groups if k is None else k, groups))
    order = [g * size + m for m in range(size - 1) for g in slotted]
    order += [g * size + m for g in range(len(slotted), groups) for m in range(size)]
    return order + [g * size + size - 1 for g in slotted]


def worker(args: argparse.Namespace) -> int:
    import psutil
    import torch

    from megathunder.config import load_config
    from megathunder.learner.learner import MegatronLearner
    from megathunder.learner.parallel import destroy_distributed, init_distributed
    from megathunder.trajectory import Trajectory, batch_plan

    cfg = load_config(None, args.overrides)
    pgs = init_distributed(cfg.learner)
    cuda = pgs.device.type == "cuda"
    gc.collect()
    baseline = psutil.Process().memory_info().rss
    learner = MegatronLearner.build(cfg.learner, cfg.objective, pgs, cfg.ledger)
    ledger = learner.ledger
    assert ledger is not None
    dp, dp_rank = pgs.dims.data_units, pgs.data_unit

    def feed(batch, rewards, order, held: bool = False) -> None:
        ledger.begin_batch(batch_plan(batch))
        if held:  # every event queued behind the first: ready work, released by close_batch
            ledger.hold()
        for t in batch:
            if t.traj_id % dp == dp_rank:
                ledger.on_finished(t)
            else:
                ledger.on_remote_finished(t.traj_id, learner.num_loss_tokens(t))
        for traj_id in order:
            ledger.on_reward(traj_id, rewards[traj_id])
        ledger.close_batch()
        learner.step()

    tiny = Trajectory(0, 0, torch.arange(8) % learner.model_cfg.vocab_size, torch.ones(7, dtype=torch.bool))
    feed([tiny], [1.0], [0])  # the optimizer's state exists from here on
    batch, rewards = _batch(cfg, learner.model_cfg.vocab_size)
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        _reset_hwm()
        before = psutil.Process().memory_info().rss
    feed(batch, rewards, reward_order(cfg, len(batch)))
    feed(batch, rewards, reward_order(cfg, len(batch)), held=True)
    if cuda:
        torch.cuda.synchronize()
        peak, start = torch.cuda.max_memory_allocated(), 0
    else:
        peak, start = _hwm(), baseline
    report = {"rank": pgs.rank, "stage": pgs.pp_rank, "baseline": baseline, "before_step": before, "peak": peak,
              "measured": peak - start, "params": sum(p.numel() for p in learner.model.parameters())}
    reports: list = [None] * pgs.world_size
    if pgs.world_size > 1:
        torch.distributed.all_gather_object(reports, report)
    else:
        reports = [report]
    if pgs.rank == 0:
        Path(args.out).write_text(json.dumps(reports))
    destroy_distributed()
    return 0


# ---------------------------------------------------------------------- the driver


def predicted_bytes(overrides: Sequence[str], world: int, gpu_memory_gb: float | None = None) -> float:
    """The plan's per-rank total for ``overrides`` on ``world`` ranks, without the process baseline
    and the weight push (which the bench does not run)."""
    from megathunder.config import load_config
    from megathunder.plan.memory_plan import Machine
    from megathunder.plan.plan_cmd import run_plan

    cfg = load_config(None, overrides)
    result = run_plan(cfg, Machine(gpu_memory_gb=gpu_memory_gb, ranks_per_node=world, host_memory_gb=1e9, world=world),
                      sizes="config")
    skip = {"process", "weight push"} | ({"runtime"} if gpu_memory_gb is not None else set())
    total = sum(line.device + (0 if gpu_memory_gb is not None else line.host) for line in result.lines
                if line.part not in skip)
    return total


def run_layout(name: str, ranks: int, overrides: Sequence[str], timeout: float, device: str = "cpu") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
               f"--master-port={_free_port()}", "-m", "megathunder.bench.memory_fit", "--worker", "--out", str(out),
               *COMMON, *overrides]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        if device == "cpu":
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{name}: ranks failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        reports = json.loads(out.read_text())
    measured = max(r["measured"] for r in reports)
    predicted = predicted_bytes([*COMMON, *overrides], ranks, 80.0 if device == "cuda" else None)
    return {"layout": name, "ranks": ranks, "measured": measured, "predicted": predicted,
            "error": (predicted - measured) / measured, "per_rank": reports}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="megathunder bench memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: peak RSS of each rank; cuda: max allocated CUDA memory (one GPU, its own layouts)")
    parser.add_argument("--layouts", nargs="+", default=None,
                        help=f"a subset of: {'; '.join(LAYOUTS)} (cuda: {'; '.join(GPU_LAYOUTS)})")
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per layout")
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    table = GPU_LAYOUTS if args.device == "cuda" else LAYOUTS
    names = args.layouts or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"unknown layouts {unknown}; known: {list(table)}")
    if args.device == "cuda":
        import importlib.util

        if importlib.util.find_spec("transformer_engine") is None:
            names = [n for n in names if "TE" not in n.split()]  # TE's layers need Transformer Engine
    rows = []
    print(f"{'layout':<36} {'ranks':>5} {'predicted GiB':>14} {'measured GiB':>13} {'error':>7}")
    for name in names:
        ranks, overrides = table[name]
        row = run_layout(name, ranks, overrides, args.timeout, args.device)
        rows.append(row)
        print(f"{name:<36} {ranks:>5} {row['predicted'] / 2**30:>14.3f} {row['measured'] / 2**30:>13.3f} "
              f"{100 * row['error']:>+6.1f}%", flush=True)
    worst = max(abs(r["error"]) for r in rows)
    print(json.dumps({"bench": "memory", "device": args.device, "tolerance": args.tolerance, "max_abs_error": round(worst, 4),
                      "rows": [{k: v for k, v in r.items() if k != "per_rank"} for r in rows],
                      "per_rank": {r["layout"]: r["per_rank"] for r in rows}}))
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
