"""One rank of a multi-process learner check, launched by torchrun from the distributed tests.

    python -m torch.distributed.run --nproc-per-node N learner_worker.py MODE --out FILE ...

MODE equivalence: from the same HF weights, take one optimizer step with the streamed (thunder)
gradient and, from the same starting point, one with the batch-synchronous gradient; rank 0
saves the full (gathered) parameters before and after each.

MODE ppo: PPO epochs and mini-batches through the sync path; the HF-named weights before and after.

MODE each: every own trajectory's gradient (a slot's score pass and a reward-free pass) from one
call each (``backward``) and from one call for all (``backward_each``), this rank's buffers.

MODE packing: the batch-synchronous gradient, the ledger's summed backward and token logprobs with
one trajectory per micro-batch and packed (``learner.pack_tokens``); no optimizer step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megathunder.streaming import synthetic as syn  # noqa: E402

from megathunder.trajectory import batch_plan  # noqa: E402
from megathunder.config import GRPOObjective, LearnerConfig, LedgerConfig  # noqa: E402
from megathunder.learner import hf  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402
from megathunder.learner.batches import grpo_gradient  # noqa: E402
from megathunder.learner.learner import MegatronLearner  # noqa: E402
from megathunder.learner.parallel import destroy_distributed, from_last_stage, init_distributed  # noqa: E402


def full_params(learner: MegatronLearner, source: str = "param") -> dict[str, torch.Tensor] | None:
    return hf.gather_full_state(learner.model, learner.model_cfg, learner.pgs, learner.offset, source)


def restore(learner: MegatronLearner, full: dict[str, torch.Tensor] | None) -> None:
    import torch.distributed as dist

    box = [full]
    dist.broadcast_object_list(box, src=0)
    hf.load_full_state(learner.model, box[0], learner.model_cfg, learner.pgs, learner.offset)


def make_batch(seed: int, vocab: int):
    rng = random.Random(seed)
    batch = syn.random_batch(rng, [3, 4, 2, 3], vocab, 24, torch.float32, empty_prob=0.1)
    rewards = syn.random_rewards(rng, batch, "binary")
    events = syn.random_event_order(rng, len(batch))
    return batch, rewards, events


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def equivalence(args) -> None:
    cfg = LearnerConfig.model_validate(_merge({
        "parallel": {"tensor_parallel": args.tp, "pipeline_parallel": args.pp},
        "model": {"hf_checkpoint": args.hf},
        "optimizer": {"name": args.optimizer, "lr": args.lr, "clip_grad": 0.0,
                      "use_distributed_optimizer": args.dist_opt},
    }, json.loads(args.learner)))  # --learner: sequence parallelism, recompute, core attention
    objective = GRPOObjective.model_validate_json(args.objective)
    pgs = init_distributed(cfg)
    ledger_cfg = LedgerConfig.model_validate({"max_group_slots": args.slots, **json.loads(args.ledger)})
    learner = MegatronLearner.build(cfg, objective, pgs, ledger_cfg)
    batch, rewards, events = make_batch(args.seed, learner.model_cfg.vocab_size)
    if args.routing:  # routing replay: every trajectory's experts from the file (routing_record)
        routed = torch.load(args.routing)["shifted"]
        batch = [dataclasses.replace(t, routed_experts=r) for t, r in zip(batch, routed, strict=True)]
    dp, dp_rank = pgs.dims.data_units, pgs.data_unit  # DP units: an expert grid may span DP ranks
    owner = [t.traj_id % dp for t in batch]
    if objective.kl_coef > 0:
        learner.fill_ref_logprobs(batch)
    before = full_params(learner)

    ledger = learner.ledger
    if args.ledger_turns:  # per-turn score gradients: GRPOBatch's events, owners claimed at first turns
        result, owner = _turn_events_batch(learner, batch, rewards, args.seed)
    else:
        ledger.begin_batch(batch_plan(batch))
        syn.feed_events(ledger, batch, rewards, events, owner=lambda t: owner[t.traj_id] == dp_rank,
                        num_loss_tokens=learner.num_loss_tokens)
        result = ledger.close_batch()
    learner.step()
    out = {"before": before, "stream": full_params(learner), "peak_buffers": result.peak_buffers,
           "peak_pending": result.peak_pending, "pending_backward": result.num_pending_backward,
           "turn_scores": getattr(result, "num_turn_scores", 0),
           "expert_buffers": _expert_buffers_in_ledger(learner),
           "fused_adam": [all(g.get("fused") for g in inner.optimizer.param_groups)  # CPU: _fused_torch_adam
                          for inner in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])]}
    if args.routing:
        restore(learner, before)
        out["logp"] = from_last_stage(pgs, learner.token_logprobs(batch))
    if not args.dist_opt:  # all-reduced: every rank's buffers hold the full gradient
        out["stream_grad"] = full_params(learner, "main_grad")

    restore(learner, before)
    for inner in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer]):  # MoE: dense + experts
        inner.optimizer.state.clear()  # fresh Adam moments for the second path
    passes = learner.forward_backward.num_passes
    grpo_gradient(learner, batch, rewards, owner)
    out["sync_passes"] = learner.forward_backward.num_passes - passes
    learner.step()
    out["sync"] = full_params(learner)
    if not args.dist_opt:
        out["sync_grad"] = full_params(learner, "main_grad")
    if args.router_parts:  # MoE router losses: the batch gradient with each of the two terms alone
        config = learner.model.config
        coeffs = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
        for name, aux, z in (("aux_only", coeffs[0], 0.0), ("z_only", 0.0, coeffs[1])):
            config.moe_aux_loss_coeff, config.moe_z_loss_coeff = aux, z
            restore(learner, before)
            grpo_gradient(learner, batch, rewards, owner)
            finalize_model_grads([learner.ddp], None, pg_collection=pgs.collection)  # the DP sum, as ``step``
            out[f"sync_grad_{name}"] = full_params(learner, "main_grad")
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff = coeffs
    if pgs.rank == 0:
        torch.save(out, args.out)
    destroy_distributed()


def _turn_events_batch(learner: MegatronLearner, batch, rewards, seed: int):
    """The streamed batch through ``GRPOBatch`` with turn events (``ledger.per_turn_scores``): every
    trajectory's turns (its loss mask's runs) interleaved at random with other trajectories' turns,
    finishes and rewards. Returns the close's outcome and each trajectory's DP owner."""
    from megathunder.learner.batches import GRPOBatch
    from megathunder.trajectory import turn_spans

    rng = random.Random(seed + 1)
    queues = [[("turn", t.traj_id, k) for k in range(len(turn_spans(t)))]
              + [("finished", t.traj_id, -1), ("reward", t.traj_id, -1)] for t in batch]
    gb = GRPOBatch(learner, batch_plan(batch), streamed=True)
    while any(queues):
        kind, tid, k = rng.choice([q for q in queues if q]).pop(0)
        if kind == "turn":
            start, end = turn_spans(batch[tid])[k]
            engine = batch[tid].rollout_logprobs[start - 1 : end - 1].tolist()
            gb.on_turn(tid, batch[tid].tokens[:end].tolist(), start, end, engine)
        elif kind == "finished":
            gb.on_finished(batch[tid])
        else:
            gb.on_reward(tid, rewards[tid])
    return gb.close(), [gb.owners.owner[t.traj_id] for t in batch]


def routing_record(args) -> None:
    """Routing replay, one process: the learner's own routing of every trajectory (Megatron's
    RouterReplay in RECORD mode, one trajectory per forward), the logprobs without replay, replaying
    its own routing, and replaying a shifted routing (expert e -> e + 1 mod E in every slot: a
    different, valid choice for every token); saves the routings and the logprobs."""
    from megathunder.bench.routing_gap import own_routing

    cfg = LearnerConfig.model_validate(_merge({"model": {"hf_checkpoint": args.hf}}, json.loads(args.learner)))
    pgs = init_distributed(cfg)
    learner = MegatronLearner.build(cfg, GRPOObjective(), pgs, LedgerConfig(max_group_slots=1))
    batch, _, _ = make_batch(args.seed, learner.model_cfg.vocab_size)
    own = own_routing(learner, batch)
    experts = learner.model_cfg.num_experts
    shifted = [((r.long() + 1) % experts).to(torch.int16) for r in own]
    out = {"own": own, "shifted": shifted, "plain": learner.token_logprobs(batch),
           "replay_own": learner.token_logprobs([dataclasses.replace(t, routed_experts=r) for t, r in zip(batch, own)]),
           "replay_shifted": learner.token_logprobs(
               [dataclasses.replace(t, routed_experts=r) for t, r in zip(batch, shifted)])}
    torch.save(out, args.out)
    destroy_distributed()


def packing(args) -> None:
    """Each path unpacked (pack_tokens 0) with the output layer at every position, and packed
    (``--pack``) with it at the loss's targets only (``learner.loss_logits_only``), from the same
    weights; the gradients DP-reduced (``finalize_model_grads``, no step), gathered on rank 0."""
    from megatron.core.distributed import finalize_model_grads

    from megathunder.learner.parallel import from_last_stage
    from megathunder.objectives import LossSpec
    from megathunder.streaming.reference import batch_advantages
    from megathunder.learner.shared_prefix import shared_rows
    from megathunder.trajectory import pack_micro_batches

    cfg = LearnerConfig.model_validate(_merge({
        "parallel": {"tensor_parallel": args.tp, "pipeline_parallel": args.pp},
        "model": {"hf_checkpoint": args.hf},
        "optimizer": {"name": "sgd", "lr": 1.0, "clip_grad": 0.0, "use_distributed_optimizer": False},
    }, json.loads(args.learner)))
    objective = GRPOObjective.model_validate_json(args.objective)
    pgs = init_distributed(cfg)
    learner = MegatronLearner.build(cfg, objective, pgs, LedgerConfig(max_group_slots=0))
    batch, rewards, _ = make_batch(args.seed, learner.model_cfg.vocab_size)
    batch = _shared_prompts(batch, args.seed, learner.model_cfg.vocab_size)
    owner = [t.traj_id % pgs.dims.dp for t in batch]
    mine = [t for t, o in zip(batch, owner, strict=True) if o == pgs.dp_rank]
    advantages, _ = batch_advantages(batch, rewards, objective)
    specs = [LossSpec(advantage=advantages[t.traj_id], reward_free=objective.has_reward_free_terms) for t in mine]

    def reduced():
        finalize_model_grads([learner.ddp], None, pg_collection=pgs.collection)  # the DP sum, as ``step``
        return full_params(learner, "main_grad")

    out: dict = {"groups": pack_micro_batches([t.tokens.numel() - 1 for t in mine], args.pack),
                 "shared_rows": [row.members for row in shared_rows(mine, args.pack)],
                 "supported": learner.forward_backward.options.share_prefixes}
    options = learner.forward_backward.options
    for name, pack, share in (("unpacked", 0, False), ("packed", args.pack, False), ("shared", args.pack, True)):
        learner.forward_backward.options = dataclasses.replace(options, pack_tokens=pack, loss_logits_only=pack > 0,
                                                               share_prefixes=share)
        if objective.kl_coef > 0:
            learner.fill_ref_logprobs(batch)
        out[f"{name}_logp"] = from_last_stage(pgs, learner.token_logprobs(batch))
        out[f"{name}_ref"] = [t.ref_logprobs for t in batch]
        grpo_gradient(learner, batch, rewards, owner)
        out[f"{name}_sync_grad"] = reduced()
        learner.backend.backward_sum(mine, specs)
        out[f"{name}_sum_grad"] = reduced()
    if pgs.rank == 0:
        torch.save(out, args.out)
    destroy_distributed()


def _shared_prompts(batch, seed: int, vocab: int):
    """The batch with each group's samples after one prompt of its own (GRPO's shape), so that
    ``learner.share_prefixes`` has prefixes to share: 2-6 common tokens put before every member."""
    gen = torch.Generator().manual_seed(seed)
    prompts: dict[int, torch.Tensor] = {}
    out = []
    for t in batch:
        length = int(torch.randint(2, 7, (1,), generator=gen))
        prompt = prompts.setdefault(t.group_id, torch.randint(0, vocab, (length,), generator=gen))
        pad = torch.full((prompt.numel(),), -1.0)
        out.append(dataclasses.replace(
            t, tokens=torch.cat([prompt, t.tokens]),
            loss_mask=torch.cat([torch.zeros(prompt.numel(), dtype=torch.bool), t.loss_mask]),
            rollout_logprobs=None if t.rollout_logprobs is None else torch.cat([pad, t.rollout_logprobs]),
            ref_logprobs=None if t.ref_logprobs is None else torch.cat([pad, t.ref_logprobs])))
    return out


def _expert_buffers_in_ledger(learner: MegatronLearner) -> tuple[int, bool]:
    """How many expert-parallel gradient buffers DDP made, and whether the ledger's live gradient
    holds every one of them (MoE under expert parallelism)."""
    expert = list(getattr(learner.ddp, "expert_parallel_buffers", None) or [])
    live = learner.backend.live.tensors
    return len(expert), all(any(t is b.grad_data for t in live) for b in expert)


def each(args) -> None:
    """Own gradients one call each vs one ``backward_each`` call; rank 0 of each stage saves
    them (PP: the stages hold different parameters, so every stage writes its own file)."""
    from megathunder.objectives import LossSpec

    objective = GRPOObjective.model_validate_json(args.objective)
    learner = _learner(args, objective)
    pgs = learner.pgs
    batch, _, _ = make_batch(args.seed, learner.model_cfg.vocab_size)
    mine = [t for t in batch if t.traj_id % pgs.dims.dp == pgs.dp_rank]
    specs = [LossSpec(advantage=-1.0, reward_free=False), LossSpec(advantage=None, reward_free=True)]
    alone = [[g.flat().clone() for g in learner.backend.backward(t, specs)] for t in mine]
    together: list[list[torch.Tensor]] = [[] for _ in mine]
    order: list[tuple[int, int]] = []

    def on_grad(k: int, j: int, live) -> None:
        order.append((k, j))
        together[k].append(live.flat().clone())

    calls = []
    run = learner.forward_backward._run
    learner.forward_backward._run = lambda *a, **kw: calls.append(len(a[1])) or run(*a, **kw)
    learner.backend.backward_each([(t, specs) for t in mine], on_grad)
    out = {"alone": alone, "together": together, "order": order, "calls": calls}
    if pgs.tp_rank == 0 and pgs.dp_rank == 0:
        torch.save(out, f"{args.out}.stage{pgs.pp_rank}")
    destroy_distributed()


def _learner(args, objective=None, temperature: float = 1.0):
    cfg = LearnerConfig.model_validate(_merge({
        "parallel": {"tensor_parallel": args.tp, "pipeline_parallel": args.pp},
        "model": {"hf_checkpoint": args.hf},
        "optimizer": {"name": args.ckpt_optimizer, "lr": 1e-2, "use_distributed_optimizer": args.dist_opt},
    }, json.loads(args.learner)))
    pgs = init_distributed(cfg)
    return MegatronLearner.build(cfg, objective or GRPOObjective(), pgs, LedgerConfig(max_group_slots=1),
                                 temperature=temperature)


def _streamed_step(learner: MegatronLearner, seed: int) -> None:
    batch, rewards, events = make_batch(seed, learner.model_cfg.vocab_size)
    dp, dp_rank = learner.pgs.dims.data_units, learner.pgs.data_unit
    ledger = learner.ledger
    ledger.begin_batch(batch_plan(batch))
    syn.feed_events(ledger, batch, rewards, events, owner=lambda t: t.traj_id % dp == dp_rank,
                    num_loss_tokens=learner.num_loss_tokens)
    ledger.close_batch()
    learner.step()


def checkpoint_save(args) -> None:
    """Two steps from the HF weights, saving after the first; rank 0 records both parameter sets."""
    from megathunder.learner.checkpoint import save_checkpoint

    learner = _learner(args)
    _streamed_step(learner, seed=1)
    save_checkpoint(learner, args.ckpt)
    after1 = full_params(learner)
    _streamed_step(learner, seed=2)
    after2 = full_params(learner)
    if learner.pgs.rank == 0:
        torch.save({"after1": after1, "after2": after2}, args.out)
    destroy_distributed()


def checkpoint_resume(args) -> None:
    """Load the latest checkpoint (any layout), record the loaded parameters, take the second step."""
    from megathunder.learner.checkpoint import latest_checkpoint, load_checkpoint

    learner = _learner(args)
    load_checkpoint(learner, latest_checkpoint(args.ckpt))
    loaded = full_params(learner)
    num_steps = learner.num_steps
    _streamed_step(learner, seed=2)
    after2 = full_params(learner)
    if learner.pgs.rank == 0:
        torch.save({"loaded": loaded, "after2": after2, "num_steps": num_steps}, args.out)
    destroy_distributed()


def hf_roundtrip(args) -> None:
    """Import the HF checkpoint into this layout, export it again, and record logprobs (at
    ``--temperature``)."""
    learner = _learner(args, temperature=args.temperature)
    learner.export_hf(args.export)
    batch, _, _ = make_batch(3, learner.model_cfg.vocab_size)
    logps = learner.token_logprobs(batch)
    if learner.pgs.is_last_stage and learner.pgs.tp_rank == 0 and learner.pgs.dp_rank == 0:
        torch.save({"logprobs": logps}, args.out)
    destroy_distributed()


def saved_bytes(args) -> None:
    """What autograd saves for the backward of one trajectory's forward (bytes of the distinct
    storages that are not parameters), on each rank: ``megathunder.plan``'s activation count is
    checked against it. Random weights of the --learner model sizes."""
    cfg = LearnerConfig.model_validate(_merge({
        "parallel": {"tensor_parallel": args.tp, "pipeline_parallel": args.pp},
        "optimizer": {"name": "sgd", "use_distributed_optimizer": False},
    }, json.loads(args.learner)))
    pgs = init_distributed(cfg)
    learner = MegatronLearner.build(cfg, GRPOObjective(), pgs, LedgerConfig())
    from megathunder.learner.micro_batches import padded_length
    from megathunder.learner.logprobs import vocab_parallel_logprobs

    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    s = padded_length(args.seq, pgs.dims.seq_multiple)
    torch.manual_seed(0)
    tokens = torch.randint(0, learner.model_cfg.vocab_size, (s,))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = learner.ddp(tokens[None], torch.arange(s)[None], attention_mask=None)
        vocab_parallel_logprobs(out[0], tokens, pgs.tp, False)
    params = {p.untyped_storage().data_ptr() for p in learner.model.parameters()}
    total = sum(n for ptr, n in seen.items() if ptr not in params)
    gathered = [None] * pgs.world_size
    torch.distributed.all_gather_object(gathered, total)
    if pgs.rank == 0:
        Path(args.out).write_text(json.dumps({"saved_bytes": gathered, "seq": s}))
    destroy_distributed()


def ppo(args) -> None:
    """PPO epochs / mini-batches through the sync path (``GRPOBatch`` at close, then ``step``);
    rank 0 saves the full weights in HF names before and after."""
    from megathunder.learner.batches import GRPOBatch
    from megathunder.learner.push import gather_to_rank0

    cfg = LearnerConfig.model_validate({
        "parallel": {"tensor_parallel": args.tp, "pipeline_parallel": args.pp},
        "model": {"hf_checkpoint": args.hf},
        "optimizer": {"name": "sgd", "lr": args.lr, "sgd_momentum": 0.0, "clip_grad": 0.0,
                      "use_distributed_optimizer": False},
    })
    learner = MegatronLearner.build(cfg, GRPOObjective.model_validate_json(args.objective), init_distributed(cfg),
                                    LedgerConfig(max_group_slots=args.slots))
    batch, rewards, _ = make_batch(args.seed, learner.model_cfg.vocab_size)

    def hf_named():
        full = gather_to_rank0(learner.model, learner.model_cfg, learner.pgs, learner.offset)
        return None if full is None else dict(full)

    before = hf_named()
    b = GRPOBatch(learner, batch_plan(batch), streamed=False)
    for t in batch:
        b.on_finished(t)
    for t, r in zip(batch, rewards, strict=True):
        b.on_reward(t.traj_id, r)
    b.close()
    result = learner.step()
    after = hf_named()
    if learner.pgs.rank == 0:
        torch.save({"before": before, "after": after, "num_steps": learner.num_steps, "lr": result.lr}, args.out)
    destroy_distributed()


def checkpoint_before_step(args) -> None:
    """A checkpoint asked for before the learner's first optimizer step (Ctrl-C during the warm
    start's first push): nothing to save, nothing written -- not Megatron's distributed optimizer
    asserting a step in its ``state_dict`` and a ``step_0.tmp`` left behind."""
    from megathunder.learner.checkpoint import latest_checkpoint, save_checkpoint

    learner = _learner(args)
    assert save_checkpoint(learner, args.ckpt) is None
    assert not Path(args.ckpt).exists() or not any(Path(args.ckpt).iterdir()), list(Path(args.ckpt).iterdir())
    assert latest_checkpoint(args.ckpt) is None
    _streamed_step(learner, seed=1)
    assert save_checkpoint(learner, args.ckpt) is not None and latest_checkpoint(args.ckpt).name == "step_1"
    destroy_distributed()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["equivalence", "checkpoint_save", "checkpoint_resume", "checkpoint_before_step",
                                    "hf_roundtrip", "saved_bytes", "ppo", "packing", "routing_record", "each"])
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--ckpt")
    p.add_argument("--export")
    p.add_argument("--out", required=True)
    p.add_argument("--hf", default=None)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--dist-opt", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0, help="hf_roundtrip: the sampling temperature")
    p.add_argument("--ckpt-optimizer", default="adam", help="checkpoint_save / checkpoint_resume: adam or sgd")
    p.add_argument("--objective", default="{}")
    p.add_argument("--pack", type=int, default=64, help="packing: learner.pack_tokens of the packed run")
    p.add_argument("--learner", default="{}", help="JSON merged into the LearnerConfig (equivalence, hf_roundtrip, "
                   "checkpoints)")
    p.add_argument("--routing", default=None, help="equivalence: replay the 'shifted' routing of this "
                   "routing_record file")
    p.add_argument("--router-parts", action="store_true", help="equivalence: also the batch gradient with the "
                   "MoE router's aux loss alone and its z-loss alone")
    p.add_argument("--ledger-turns", action="store_true", help="equivalence: stream through GRPOBatch with turn "
                   "events (set ledger.per_turn_scores in --ledger)")
    p.add_argument("--ledger", default="{}", help="JSON LedgerConfig fields besides max_group_slots (equivalence)")
    args = p.parse_args()
    {"equivalence": equivalence, "checkpoint_save": checkpoint_save, "checkpoint_resume": checkpoint_resume,
     "checkpoint_before_step": checkpoint_before_step, "hf_roundtrip": hf_roundtrip, "saved_bytes": saved_bytes, "ppo": ppo,
     "packing": packing, "routing_record": routing_record, "each": each}[args.mode](args)


if __name__ == "__main__":
    main()

