"""``megathunder bench ledger``: the ledger's memory and time cost.

Memory: the parameter-sized buffers the ledger holds at its peak, measured from its buffer pool,
for K group slots with every group open at once (the worst case), for GRPO (2 per slot) and a
std-free variant (1 per slot), against the 2K + 1 (K + 1) bound.

Time: per trajectory, the ledger's own work (buffer zeroing, copies and scaled adds; everything
it does besides the model's forward and backward) relative to that trajectory's backward pass,
both measured in the same run, for full per-trajectory streaming (K = number of groups).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Iterator, Sequence

import torch

from megathunder.config import DecoderConfig, GRPOObjective, LedgerConfig
from megathunder.models.torch_decoder import build_torch_decoder
from megathunder.objectives import LossSpec
from megathunder.streaming import GradBuffer, GradientLedger, TorchBackend
from megathunder.streaming import synthetic as syn
from megathunder.trajectory import Trajectory, batch_plan


class TimedBackend(TorchBackend):
    """Splits time into forward, backward and everything else."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.forward_s = self.backward_s = 0.0

    def backward(self, traj: Trajectory, specs: Sequence[LossSpec]) -> Iterator[GradBuffer]:
        from megathunder.objectives import token_logprobs_and_entropy, trajectory_loss

        t0 = time.perf_counter()
        logits = self.model(traj.tokens.unsqueeze(0))[0, :-1]
        logp, entropy = token_logprobs_and_entropy(logits, traj.tokens[1:], self.objective.entropy_coef > 0)
        losses = [trajectory_loss(logp, entropy, traj, s, self.objective) for s in specs]
        self.forward_s += time.perf_counter() - t0
        for k, loss in enumerate(losses):
            self.live.zero_()  # the ledger's cost: counted outside forward and backward
            t0 = time.perf_counter()
            loss.backward(retain_graph=k + 1 < len(losses))
            self.backward_s += time.perf_counter() - t0
            self.num_backward += 1
            yield self.live


def _round_robin_events(group_sizes: Sequence[int]) -> list[syn.Event]:
    ids, start = [], 0
    for size in group_sizes:
        ids.append(list(range(start, start + size)))
        start += size
    order = [g[k] for k in range(max(group_sizes)) for g in ids if k < len(g)]
    return [syn.Event(kind, i) for i in order for kind in ("finished", "reward")]


def _run(ledger: GradientLedger, batch, rewards, events) -> float:
    t0 = time.perf_counter()
    ledger.begin_batch(batch_plan(batch))
    syn.feed_events(ledger, batch, rewards, events)
    ledger.close_batch()
    return time.perf_counter() - t0


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="megathunder bench ledger", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--num-groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slots", type=int, nargs="+", default=[0, 1, 2, 4])
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model_cfg = DecoderConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                            num_layers=args.num_layers, num_heads=max(1, args.hidden_size // 64),
                            max_seq_len=args.seq_len)
    model = build_torch_decoder(model_cfg)
    num_params = sum(p.numel() for p in model.parameters())
    rng = random.Random(0)
    sizes = [args.group_size] * args.num_groups
    batch = []
    for t in syn.random_batch(rng, sizes, args.vocab_size, args.seq_len, empty_prob=0.0):
        t.tokens = torch.randint(0, args.vocab_size, (args.seq_len,))
        t.loss_mask = torch.ones(args.seq_len - 1, dtype=torch.bool)
        t.loss_mask[:16] = False
        t.rollout_logprobs = t.ref_logprobs = None
        t.truncated = False
        batch.append(t)
    rewards = [float(i % 2) for i in range(len(batch))]
    events = _round_robin_events(sizes)
    print(f"model: {num_params / 1e6:.2f}M parameters, {args.seq_len}-token trajectories, "
          f"{args.num_groups} groups x {args.group_size}")

    # Memory: peak parameter-sized buffers per K (all groups open at once).
    memory = []
    print(f"\n{'advantage':<10} {'K':>4} {'peak buffers':>13} {'bound':>6} {'MiB':>8}")
    for advantage, per_slot in (("grpo", 2), ("rloo", 1)):
        objective = GRPOObjective(advantage=advantage)
        for k in args.slots:
            backend = TorchBackend(model, objective)
            ledger = GradientLedger(backend, objective, LedgerConfig(max_group_slots=k))
            _run(ledger, batch, rewards, events)
            peak = ledger.pool.peak_live
            bound = per_slot * min(k, args.num_groups) + 1
            mib = peak * backend.live.nbytes / 2**20
            memory.append({"advantage": advantage, "K": k, "peak_buffers": peak, "bound": bound, "MiB": round(mib, 1)})
            print(f"{advantage:<10} {k:>4} {peak:>13} {bound:>6} {mib:>8.1f}")

    # Time: ledger overhead per trajectory vs the trajectory's own backward (K = all groups).
    # One ledger across batches, as in training: its buffer pool is allocated in the warm-up batch.
    objective = GRPOObjective(advantage="grpo")
    backend = TimedBackend(model, objective)
    ledger = GradientLedger(backend, objective, LedgerConfig(max_group_slots=None))
    _run(ledger, batch, rewards, events)
    overheads, backward_ms, overhead_ms = [], [], []
    for _ in range(args.repeats):
        backend.forward_s = backend.backward_s = 0.0
        total_s = _run(ledger, batch, rewards, events)
        n = len(batch)
        own = (total_s - backend.forward_s - backend.backward_s) / n
        bwd = backend.backward_s / n
        overheads.append(own / bwd)
        backward_ms.append(bwd * 1e3)
        overhead_ms.append(own * 1e3)
    ratio = statistics.median(overheads)
    print(f"\nper trajectory (median of {args.repeats}): backward {statistics.median(backward_ms):.1f} ms, "
          f"ledger overhead {statistics.median(overhead_ms):.2f} ms = {100 * ratio:.2f}% of backward "
          f"(target <= 5%)")
    print(json.dumps({
        "bench": "ledger",
        "num_params": num_params,
        "seq_len": args.seq_len,
        "memory": memory,
        "memory_within_bound": all(m["peak_buffers"] == m["bound"] for m in memory),
        "backward_ms_per_traj": round(statistics.median(backward_ms), 2),
        "overhead_ms_per_traj": round(statistics.median(overhead_ms), 3),
        "overhead_vs_backward": round(ratio, 4),
    }))
    return 0
