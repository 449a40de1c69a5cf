"""``megathunder bench learner``: the Megatron learner's step time, streamed vs synchronous.

The same batch is trained three ways from the same weights, each ending in one data-parallel
reduce and one optimizer step: ``sync`` (all rewards known: the batch's trajectories as the
micro-batches of one schedule call), and ``thunder`` with K = 0 and K = unbounded group slots,
fed every finish event and then every reward (all rewards arriving at once: the case where
streaming can only cost, never gain, so the ratio measures its overhead), and ``thunder_held``:
the same events as the trainer delivers a burst -- each queued behind the next, so the ledger
holds their work and the last one releases it (ready-work packing: everything in one packed
``backward_sum``, sync's own work). Reports step times,
the thunder/sync ratio, training tokens/s and, on GPUs, model FLOPs utilisation from the model's
FLOPs (6 N + 12 L h s a token: ``megathunder.plan.flops``, the trainer's and the sweep's formula;
HFU with recomputation counted). ``--nproc N`` relaunches itself under torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import torch



def _args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megathunder bench learner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1, help="processes (relaunch under torchrun)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pack-tokens", type=int, default=None,
                   help="learner.pack_tokens (default: the config's; 0: one trajectory per micro-batch)")
    p.add_argument("--loss-logits-only", choices=["true", "false"], default=None,
                   help="learner.loss_logits_only (default: the config's, true): the output layer only at the "
                        "loss's targets")
    p.add_argument("--share-prefixes", choices=["true", "false"], default=None,
                   help="learner.share_prefixes (default: the config's, true): a group's trajectories in one row, "
                        "their common prompt once (the batch's groups share their prompts, as GRPO's do)")
    p.add_argument("--loss-tokens", type=int, default=None,
                   help="loss-mask targets per trajectory, its last ones (default: all but the first 16)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--layer-spec", choices=["local", "transformer_engine"], default="local")
    p.add_argument("--fp8", choices=["e4m3", "hybrid"], default=None)
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: by GPU name)")
    args = p.parse_args(argv)
    if args.loss_tokens is not None and not 1 <= args.loss_tokens <= args.seq_len:
        p.error(f"--loss-tokens: between 1 and --seq-len ({args.seq_len}); got {args.loss_tokens}")
    return args


def _relaunch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
           f"--master-port={port}", "-m", "megathunder.cli", "bench", "learner", *argv]
    return subprocess.call(cmd)


def _sync_time(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def main(argv: Sequence[str]) -> int:
    args = _args(argv)
    if args.nproc > 1 and "RANK" not in os.environ:
        child = list(argv)
        for i, a in enumerate(child):  # the children know their world from torchrun
            if a == "--nproc":
                del child[i : i + 2]
                break
            if a.startswith("--nproc="):
                del child[i]
                break
        return _relaunch(args, child)

    from megathunder.config import GRPOObjective, LearnerConfig, LedgerConfig
    from megathunder.learner.batches import grpo_gradient
    from megathunder.learner.learner import MegatronLearner
    from megathunder.learner.parallel import destroy_distributed, init_distributed
    from megathunder.plan.flops import peak_tflops, training_flops, utilisation
    from megathunder.plan.memory_plan import ModelShape
    from megathunder.streaming import synthetic as syn
    from megathunder.trajectory import batch_plan

    cfg = LearnerConfig.model_validate({
        "parallel": {"tensor_parallel": args.tp, "pipeline_parallel": args.pp},
        "model": {"vocab_size": args.vocab_size, "hidden_size": args.hidden_size,
                  "ffn_hidden_size": 4 * args.hidden_size, "num_layers": args.num_layers,
                  "num_attention_heads": args.num_heads, "num_query_groups": max(1, args.num_heads // 2),
                  "max_position_embeddings": args.seq_len + 1, "tie_word_embeddings": False},
        "precision": {"params_dtype": args.dtype, "layer_spec": args.layer_spec, "fp8": args.fp8},
        "optimizer": {"lr": 1e-6},
        **({} if args.pack_tokens is None else {"pack_tokens": args.pack_tokens}),
        **({} if args.loss_logits_only is None else {"loss_logits_only": args.loss_logits_only == "true"}),
        **({} if args.share_prefixes is None else {"share_prefixes": args.share_prefixes == "true"}),
    })
    objective = GRPOObjective(advantage="grpo")
    pgs = init_distributed(cfg)
    learner = MegatronLearner.build(cfg, objective, pgs)
    prompt_len = 16 if args.loss_tokens is None else args.seq_len - args.loss_tokens  # untrained targets
    rng = random.Random(0)
    batch = syn.random_batch(rng, [args.group_size] * args.num_groups, args.vocab_size, args.seq_len + 1,
                             empty_prob=0.0)
    prompts = {g: torch.randint(0, args.vocab_size, (prompt_len,)) for g in range(args.num_groups)}
    for t in batch:  # a group's samples continue one prompt
        t.tokens = torch.cat([prompts[t.group_id], torch.randint(0, args.vocab_size, (args.seq_len + 1 - prompt_len,))])
        t.loss_mask = torch.ones(args.seq_len, dtype=torch.bool)
        t.loss_mask[:prompt_len] = False
        t.rollout_logprobs = t.ref_logprobs = None
        t.truncated = False
    rewards = [float(rng.random() < 0.5) for _ in batch]
    dp, dp_rank = pgs.dims.data_units, pgs.data_unit
    owner = [t.traj_id % dp for t in batch]
    plan = batch_plan(batch)
    all_at_once = [syn.Event("finished", t.traj_id) for t in batch] + [syn.Event("reward", t.traj_id) for t in batch]

    def run_sync() -> None:
        grpo_gradient(learner, batch, rewards, owner)
        learner.step()

    def run_thunder(slots: int | None, held: bool = False) -> None:
        from megathunder.streaming import GradientLedger

        key = (slots, held)
        ledger = ledgers.setdefault(key, GradientLedger(learner.backend, objective, LedgerConfig(max_group_slots=slots)))
        ledger.begin_batch(plan)
        queued = [True] * (len(all_at_once) - 1) + [False] if held else None  # the last event releases
        syn.feed_events(ledger, batch, rewards, all_at_once, owner=lambda t: owner[t.traj_id] == dp_rank,
                        num_loss_tokens=learner.num_loss_tokens, queued=queued)
        ledger.close_batch()
        learner.step()

    ledgers: dict = {}
    modes = {"sync": run_sync, "thunder_K0": lambda: run_thunder(0), "thunder_Kinf": lambda: run_thunder(None),
             "thunder_held": lambda: run_thunder(None, held=True)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for fn in modes.values():  # warm-up (allocations, first-call costs)
        fn()
    for _ in range(args.repeats):
        for name, fn in modes.items():  # interleaved, so machine noise hits every mode alike
            t0 = _sync_time(pgs.device)
            fn()
            times[name].append(_sync_time(pgs.device) - t0)

    median = {m: statistics.median(v) for m, v in times.items()}
    tokens = sum(t.tokens.numel() - 1 for t in batch)
    num_params = sum(p.numel() for p in learner.model.parameters()) * pgs.dims.tp * pgs.dims.pp
    flops = training_flops(ModelShape.of(learner.model_cfg), [t.tokens.numel() - 1 for t in batch],
                           cfg.activations.recompute)
    result = {
        "bench": "learner",
        "layout": {"tp": pgs.dims.tp, "pp": pgs.dims.pp, "dp": pgs.dims.dp},
        "device": torch.cuda.get_device_name() if pgs.device.type == "cuda" else "cpu",
        "dtype": args.dtype, "layer_spec": args.layer_spec, "fp8": args.fp8,
        "num_params": num_params, "tokens_per_step": tokens, "pack_tokens": cfg.pack_tokens,
        "loss_logits_only": cfg.loss_logits_only, "share_prefixes": learner.forward_backward.options.share_prefixes,
        "step_s": {k: round(v, 4) for k, v in median.items()},
        "ratio_thunder_K0_vs_sync": round(median["thunder_K0"] / median["sync"], 4),
        "ratio_thunder_Kinf_vs_sync": round(median["thunder_Kinf"] / median["sync"], 4),
        "ratio_thunder_held_vs_sync": round(median["thunder_held"] / median["sync"], 4),
        # schedule calls per rank: one packed; one per closing group; one per own trajectory; one
        "calls": {"sync": 1, "thunder_K0": args.num_groups, "thunder_Kinf": sum(o == dp_rank for o in owner),
                  "thunder_held": 1},
        "tokens_per_s_sync": round(tokens / median["sync"], 1),
        "tokens_per_s_thunder_Kinf": round(tokens / median["thunder_Kinf"], 1),
    }
    from megathunder.simulate.call_cost import bench_points, fit_call_cost

    F, _, residual = fit_call_cost(bench_points(result))
    result["call_overhead_s"] = round(F, 5)  # the simulator's learner.call_overhead_s
    result["call_fit_residual_s"] = round(residual, 5)
    if pgs.device.type == "cuda":
        name = torch.cuda.get_device_name()
        peak = args.peak_tflops or peak_tflops(name)
        if peak:
            for mode in ("sync", "thunder_Kinf"):
                result[f"mfu_{mode}"] = round(utilisation(flops.model, median[mode], pgs.world_size, peak), 4)
                result[f"hfu_{mode}"] = round(utilisation(flops.hardware, median[mode], pgs.world_size, peak), 4)
    if pgs.rank == 0:
        print(f"model {num_params / 1e6:.2f}M params, {len(batch)} trajectories x {args.seq_len} tokens, "
              f"layout tp={pgs.dims.tp} pp={pgs.dims.pp} dp={pgs.dims.dp}, pack_tokens {cfg.pack_tokens}, "
              f"{result['device']}")
        for k, v in median.items():
            print(f"  {k:<14} step {v * 1e3:9.1f} ms   {tokens / v:10.0f} tokens/s")
        print(f"  thunder/sync: K=0 {result['ratio_thunder_K0_vs_sync']:.3f}, "
              f"K=unbounded {result['ratio_thunder_Kinf_vs_sync']:.3f}, "
              f"held burst {result['ratio_thunder_held_vs_sync']:.3f} (target <= 1.05)")
        print(f"  a call's fixed cost: {result['call_overhead_s'] * 1e3:.1f} ms (slope of step time over "
              f"{result['calls']} calls; largest residual {result['call_fit_residual_s'] * 1e3:.1f} ms)")
        print(json.dumps(result))
    destroy_distributed()
    return 0
