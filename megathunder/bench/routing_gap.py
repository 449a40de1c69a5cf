"""``megathunder bench routing``: how often vLLM's and the learner's MoE routers disagree on the same
tokens, and the logprob gap between the two with and without routing replay.

A tiny random Qwen3-MoE (or ``--model``) in the Megatron learner (fp32, one process) and in an
in-process vLLM engine recording its routing (``rollout.engine.record_routing``), the learner's
weights pushed into it. ``--samples`` completions of ``--tokens`` tokens are sampled; for each, the
learner's own routing (Megatron's ``RouterReplay`` in RECORD mode) is compared with vLLM's, position
by position and layer by layer (the set of top-k experts), and the learner's logprobs of the
sampled tokens are compared with vLLM's, once routing by itself and once replaying vLLM's routing;
the experts the replaying forward actually used (every router's routing map) are compared with
vLLM's too ("replayed differently": 0 when replay does its job).
Per engine dtype: a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megathunder.learner.learner import MegatronLearner
from megathunder.learner.routing_replay import replay_routers
from megathunder.trajectory import Trajectory


def own_routing(learner: MegatronLearner, trajs: Sequence[Trajectory]) -> list[torch.Tensor]:
    """The experts the learner's own routers pick for each trajectory's input positions, [T - 1,
    layers, top_k] int16 (``RouterReplay`` in RECORD mode, one trajectory per forward). One process
    only: under SP or PP a rank records only its own rows and layers."""
    if learner.pgs.dims.tp * learner.pgs.dims.pp > 1:
        raise ValueError("own_routing: one model-parallel rank only (TP = PP = 1)")
    routers = sorted(replay_routers(learner.ddp), key=lambda r: r[0])
    out = []
    for traj in trajs:
        for _, replay in routers:
            replay.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            learner.token_logprobs([dataclasses.replace(traj, routed_experts=None)])
            layers = [replay.get_recorded_indices()[: traj.num_targets] for _, replay in routers]
        finally:
            for _, replay in routers:
                replay.clear_indices()
                replay.clear_router_replay_action()
        out.append(torch.stack(layers, dim=1).to(torch.int16).cpu())
    return out


def used_routing(learner: MegatronLearner, trajs: Sequence[Trajectory]) -> list[torch.Tensor]:
    """The experts the learner's MoE layers actually used for each trajectory's input positions in
    its (replaying, when the trajectory carries routing) forward, read from every router's routing
    map: [T - 1, layers, top_k] int16, sorted per token. One process only, one trajectory per forward."""
    from megatron.core.transformer.moe.router import TopKRouter

    if learner.pgs.dims.tp * learner.pgs.dims.pp > 1:
        raise ValueError("used_routing: one model-parallel rank only (TP = PP = 1)")
    routers = sorted(((m.layer_number - 1, m) for m in learner.ddp.modules() if isinstance(m, TopKRouter)),
                     key=lambda r: r[0])
    seen: dict[int, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out, layer=layer: seen.__setitem__(layer, out[1].detach()))
             for layer, m in routers]
    out = []
    try:
        for traj in trajs:
            learner.token_logprobs([traj])
            top_k = learner.model_cfg.moe_router_topk
            layers = [seen[layer][: traj.num_targets].nonzero()[:, 1].view(-1, top_k) for layer, _ in routers]
            out.append(torch.stack(layers, dim=1).to(torch.int16).cpu())
    finally:
        for h in hooks:
            h.remove()
    return out


async def _measure(model_dir: Path, engine_dtype: str, args: argparse.Namespace) -> dict:
    from megathunder.config import EngineConfig, GRPOObjective, LearnerConfig
    from megathunder.learner.parallel import init_distributed
    from megathunder.learner.push import gather_to_rank0
    from megathunder.rollout.engines import InProcessEngine, start_engine
    from megathunder.rollout.types import SamplingParams

    cfg = LearnerConfig.model_validate({"moe": {"routing_replay": True},
                                        "optimizer": {"name": "sgd", "use_distributed_optimizer": False}})
    learner = MegatronLearner.build(cfg, GRPOObjective(), init_distributed(cfg), hf_dir=model_dir)
    engine = await start_engine(EngineConfig(dtype=engine_dtype, max_model_len=512, enforce_eager=True,
                                             kv_cache_memory_bytes=64 * 2**20, weight_transfer={"kind": "rpc"},
                                             record_routing=True), model_dir, log_dir=args.log_dir)
    assert isinstance(engine, InProcessEngine)
    gen = torch.Generator().manual_seed(0)
    vocab = learner.model_cfg.vocab_size
    try:
        weights = gather_to_rank0(learner.model, learner.model_cfg, learner.pgs, learner.offset)
        assert weights is not None
        await engine.update_weights(weights, 0)
        trajs, engine_logp = [], []
        for seed in range(args.samples):
            prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=gen).tolist()
            out = await engine.generate(prompt, SamplingParams(max_new_tokens=args.tokens, seed=seed, ignore_eos=True))
            tokens = prompt + list(out.token_ids)
            mask = torch.zeros(len(tokens) - 1, dtype=torch.bool)
            mask[len(prompt) - 1:] = True
            routed = torch.from_numpy((await engine.routed_experts(tokens)).copy())
            trajs.append(Trajectory(seed, seed, torch.tensor(tokens), mask, routed_experts=routed))
            engine_logp.append(torch.tensor(out.logprobs))
    finally:
        await engine.close()
    own = own_routing(learner, trajs)
    used = used_routing(learner, trajs)  # what the replaying forward routed by, per token
    plain = learner.token_logprobs([Trajectory(t.traj_id, t.group_id, t.tokens, t.loss_mask) for t in trajs])
    replayed = learner.token_logprobs(trajs)
    assert plain is not None and replayed is not None
    positions = differ = replay_differs = 0
    gaps: dict[str, list[float]] = {"plain": [], "replay": []}
    for t, mine, used_t, e, p, r in zip(trajs, own, used, engine_logp, plain, replayed, strict=True):
        assert t.routed_experts is not None and int(t.routed_experts.min()) >= 0  # every input position recorded
        same = (mine.sort(dim=-1).values == t.routed_experts.sort(dim=-1).values).all(dim=-1)  # [T-1, layers]
        positions += same.numel()
        differ += int((~same).sum())
        replay_differs += int((used_t != t.routed_experts.sort(dim=-1).values).any(dim=-1).sum())
        gen_slice = slice(t.num_targets - e.numel(), t.num_targets)
        gaps["plain"] += (p[gen_slice] - e).abs().tolist()
        gaps["replay"] += (r[gen_slice] - e).abs().tolist()
    return {"engine_dtype": engine_dtype, "samples": len(trajs), "routed_positions": positions,
            "routing_differs": differ, "routing_differs_frac": differ / positions,
            "replayed_routing_differs": replay_differs,
            **{f"{k}_gap_max": max(v) for k, v in gaps.items()},
            **{f"{k}_gap_mean": sum(v) / len(v) for k, v in gaps.items()}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megathunder bench routing", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF MoE directory (default: a tiny random Qwen3-MoE)")
    parser.add_argument("--engine-dtypes", default="float32,bfloat16")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)

    from megathunder.models.tiny_hf import TinyModelSpec, save_tiny_qwen2

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else save_tiny_qwen2(
            Path(tmp) / "tiny_moe", TinyModelSpec(num_experts=8, num_experts_per_tok=2))
        args.log_dir = Path(tmp) / "logs"
        for dtype in args.engine_dtypes.split(","):
            results.append(asyncio.run(_measure(model_dir, dtype, args)))
    print(f"\nrouting replay: learner float32, {args.samples} samples x {args.tokens} tokens")
    print(f"{'engine':<9} {'positions x layers':>18} {'routed differently':>19} {'replayed differently':>21} "
          f"{'gap max (own)':>14} {'gap max (replay)':>17} {'mean (own)':>11} {'mean (replay)':>14}")
    for r in results:
        print(f"{r['engine_dtype']:<9} {r['routed_positions']:>18} "
              f"{r['routing_differs']:>8} ({100 * r['routing_differs_frac']:5.2f}%) {r['replayed_routing_differs']:>21} "
              f"{r['plain_gap_max']:>14.2e} {r['replay_gap_max']:>17.2e} "
              f"{r['plain_gap_mean']:>11.2e} {r['replay_gap_mean']:>14.2e}")
    print(json.dumps({"bench": "routing", "rows": results}))
    return 0
