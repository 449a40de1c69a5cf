"""One rank of the per-turn OPD check on the Megatron learner, launched by torchrun.

    python -m torch.distributed.run --nproc-per-node N opd_worker.py opd --out FILE --hf S --teacher-hf T

From the student's HF weights, for each strategy: the batch-synchronous OPD gradient on full
trajectories (the learner's own Megatron schedule, teacher scoring whole trajectories) and one SGD
step from it; then, from the same start, the per-turn streamed gradient (turn events of several
trajectories interleaved, the teacher scoring each turn on its K/V cache) and one SGD step. Rank 0
saves the full (gathered) gradients and parameters.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megathunder.config import LearnerConfig, OPDGRPOObjective, OPDObjective  # noqa: E402
from megathunder.learner.batches import (  # noqa: E402
    OPDGRPOBatch,
    finish_opd_stream,
    grpo_gradient,
    opd_gradient,
    opd_streamer,
)
from megathunder.learner.forward_backward import ForwardBackward, PassOptions  # noqa: E402
from megathunder.learner.learner import MegatronLearner  # noqa: E402
from megathunder.learner.parallel import destroy_distributed, init_distributed  # noqa: E402
from megathunder.learner.segment_model import MegatronSegmentModel  # noqa: E402
from megathunder.learner.teacher import build_teacher  # noqa: E402
from megathunder.objectives.opd import opd_coefficients, opd_loss, opd_normaliser  # noqa: E402
from megathunder.streaming.opd_turns import accumulate_full_trajectory_gjsd  # noqa: E402
from megathunder.trajectory import Trajectory, turn_spans  # noqa: E402
from tests.distributed.learner_worker import full_params, make_batch, restore  # noqa: E402
from tests.opd_helpers import flatten, interleaved, random_episode, stream  # noqa: E402

BETA = 0.7
JSD_LAM = 0.3
BETA_GJSD = 10.0  # the JSD is small (bounded by log 2): a step that fp32 parameters resolve


def opd(args) -> None:
    strategies = args.strategies.split(",")
    cfg = LearnerConfig.model_validate({
        "parallel": {"tensor_parallel": args.tp},
        "model": {"hf_checkpoint": args.hf},
        "precision": {"core_attention": "past_kv"},
        "optimizer": {"name": "sgd", "lr": 1.0, "clip_grad": 0.0, "use_distributed_optimizer": False},
    })
    objective = OPDObjective(strategy=strategies[0], beta=BETA_GJSD if args.divergence == "gjsd" else BETA,
                             aggregation=args.aggregation, divergence=args.divergence, jsd_lam=JSD_LAM)
    pgs = init_distributed(cfg)
    learner = MegatronLearner.build(cfg, objective, pgs)
    teacher = build_teacher(args.teacher_hf, cfg, pgs)
    vocab = learner.model_cfg.vocab_size
    rng = random.Random(args.seed)
    episodes = [random_episode(rng, vocab) for _ in range(args.num_trajectories)]
    full = [flatten(e) for e in episodes]
    out = {"before": full_params(learner), "strategies": {}}

    # Logprobs of the past_kv model on whole sequences (the plain causal path), vs transformers.
    out["logprobs"] = learner.token_logprobs(make_batch(3, vocab)[0])

    # Teacher logprobs of whole trajectories, one plain forward each (no cache).
    teacher_full = []
    with torch.no_grad():
        for tokens, _ in full:
            logits, _ = teacher.model.forward_segment(tokens, None)
            teacher_full.append(teacher.model.logprobs(logits[:-1], tokens[1:]).cpu())

    # Batch-synchronous OPD through the learner's Megatron schedule.
    dp, dp_rank = pgs.dims.dp, pgs.dp_rank
    mine = [i for i in range(len(full)) if i % dp == dp_rank]  # data parallel: each rank its share
    items = [Trajectory(i, i, *full[i]) for i in mine if full[i][0].numel() > 1]
    learner.ddp.zero_grad_buffer()
    if args.divergence == "gjsd":  # batch GJSD on full trajectories, teacher rows from plain forwards
        seg = MegatronSegmentModel(learner.ddp, pgs)
        with torch.no_grad():
            rows = [teacher.model.log_softmax(teacher.model.forward_segment(full[i][0], None)[0][:-1]) for i in mine]
        accumulate_full_trajectory_gjsd(seg, [(*full[i], r) for i, r in zip(mine, rows, strict=True)], BETA_GJSD, JSD_LAM)
    else:
        ForwardBackward(learner.ddp, pgs, PassOptions()).backward(  # one trajectory a micro-batch, every logit
            items,
            lambda ks, logp, _ent: opd_loss(logp, opd_coefficients(  # logp: at the loss targets
                logp, torch.cat([teacher_full[items[k].traj_id][items[k].loss_mask] for k in ks]).to(logp),
                torch.ones_like(logp, dtype=torch.bool), BETA)),
        )
    learner.backend.live.div_(opd_normaliser([int(m.sum()) for _, m in full], args.aggregation))
    learner.step()
    out["sync_grad"], out["sync"] = full_params(learner, "main_grad"), full_params(learner)

    for strategy in strategies:
        restore(learner, out["before"])
        learner.optimizer.optimizer.state.clear()  # SGD momentum: every path takes a first step
        objective.strategy = strategy
        streamer = opd_streamer(learner, teacher)
        teacher.stats["forward_tokens"] = 0
        stream(streamer, [episodes[i] for i in mine], seed=args.seed)
        finish_opd_stream(learner, streamer)  # Z over every rank's trajectories
        learner.step()
        out["strategies"][strategy] = {
            "grad": full_params(learner, "main_grad"), "params": full_params(learner),
            "stats": dict(streamer.stats), "teacher_forward_tokens": teacher.stats["forward_tokens"],
        }
    out["num_tokens"] = [int(t.numel()) for t, _ in full]
    out["last_trained"] = [max((i for i in range(len(m)) if m[i]), default=-1) + 2 for _, m in full]
    if dp > 1:  # every rank's teacher forwards, summed over the data-parallel ranks
        import torch.distributed as dist

        for res in out["strategies"].values():
            box = torch.tensor([res["teacher_forward_tokens"]])
            dist.all_reduce(box, group=pgs.dp)
            res["teacher_forward_tokens"] = int(box)
    if pgs.rank == 0:
        torch.save(out, args.out)
    destroy_distributed()


def opd_grpo(args) -> None:
    """objective.kind=opd_grpo through the trainer's ``OPDGRPOBatch`` on this learner: from the same
    start, the sync path (both parts at batch close) and the thunder path (turns, finishes and
    rewards interleaved at random: KL per turn, rewards through the ledger's group slots), one SGD
    step each. On one rank also the sum of the two existing references, GRPO's ``grpo_gradient``
    and OPD's ``opd_gradient`` (token_mean: the same Z)."""
    cfg = LearnerConfig.model_validate({
        "parallel": {"tensor_parallel": args.tp},
        "model": {"hf_checkpoint": args.hf},
        "precision": {"core_attention": "past_kv"},
        "optimizer": {"name": "sgd", "lr": 1.0, "clip_grad": 0.0, "use_distributed_optimizer": False},
    })
    objective = OPDGRPOObjective(strategy=args.strategies.split(",")[0], beta=BETA, advantage="grpo",
                                 loss_agg="token_mean")
    pgs = init_distributed(cfg)
    learner = MegatronLearner.build(cfg, objective, pgs)
    teacher = build_teacher(args.teacher_hf, cfg, pgs)
    rng = random.Random(args.seed)
    trajs = []
    while len(trajs) < args.num_trajectories:  # groups of 3; a trajectory has >= 2 tokens
        tokens, mask = flatten(random_episode(rng, learner.model_cfg.vocab_size))
        if tokens.numel() >= 2:
            trajs.append(Trajectory(len(trajs), len(trajs) // 3, tokens, mask))
    plan = [(g, [t.traj_id for t in trajs if t.group_id == g]) for g in sorted({t.group_id for t in trajs})]
    rewards = [float(rng.random() < 0.5) + 0.1 * rng.random() for _ in trajs]
    out = {"before": full_params(learner)}

    def take_step(key):
        learner.step()
        out[key] = {"grad": full_params(learner, "main_grad"), "params": full_params(learner)}
        restore(learner, out["before"])
        learner.optimizer.optimizer.state.clear()

    if pgs.dims.dp == 1:
        grpo_gradient(learner, trajs, rewards)
        take_step("grpo_reference")
        opd_gradient(learner, [t for t in trajs if t.loss_mask.any()], teacher)
        take_step("opd_reference")
    for mode in ("sync", "thunder"):
        batch = OPDGRPOBatch(learner, teacher, plan, streamed=mode == "thunder")
        spans = {t.traj_id: turn_spans(t) for t in trajs}
        for kind, tid, k in interleaved({t: len(s) for t, s in spans.items()}, rng, rewards=True):
            if kind == "part":
                start, end = spans[tid][k]
                batch.on_turn(tid, trajs[tid].tokens[:end].tolist(), start, end)
            elif kind == "end":
                batch.on_finished(trajs[tid])
            else:
                batch.on_reward(tid, rewards[tid])
        outcome = batch.close()
        take_step(mode)
        out[mode]["divergence"] = outcome.divergence
        out[mode]["backward_after_last_reward"] = outcome.backward_after_last_reward
    if pgs.rank == 0:
        torch.save(out, args.out)
    destroy_distributed()


@torch.no_grad()
def sample_episode(seg, gen: torch.Generator, rng: random.Random, vocab: int, num_turns: int):
    """A multi-turn episode whose turns the student samples (on its own K/V cache); tool outputs
    are random tokens, some turns and tool outputs empty."""
    parts = [("prompt", [rng.randrange(vocab) for _ in range(3)])]
    pending, kv, last = list(parts[0][1]), None, None
    for k in range(num_turns):
        turn = []
        for _ in range(rng.choice([0, 2, 3, 4])):
            if pending:
                logits, new = seg.forward_segment(torch.tensor(pending), kv)
                kv = new if kv is None else [(torch.cat([a, c]), torch.cat([b, d])) for (a, b), (c, d) in zip(kv, new)]
                last, pending = logits[-1].float(), []
            token = int(torch.multinomial(torch.softmax(last, -1), 1, generator=gen))
            turn.append(token)
            pending = [token]
        parts.append(("turn", turn))
        if k + 1 < num_turns:
            tool = [rng.randrange(vocab) for _ in range(rng.choice([0, 1, 2]))]
            parts.append(("tool", tool))
            pending += tool
    return parts


@torch.no_grad()
def reverse_kl(student_seg, teacher_seg, episodes) -> float:
    """Mean over the trained positions of KL(student || teacher), exact over the vocabulary."""
    total, count = 0.0, 0
    for tokens, mask in (flatten(e) for e in episodes):
        if not mask.any():
            continue
        ls = torch.log_softmax(student_seg.forward_segment(tokens, None)[0][:-1].float(), -1)[mask]
        lt = torch.log_softmax(teacher_seg.forward_segment(tokens, None)[0][:-1].float(), -1)[mask]
        total += float((ls.exp() * (ls - lt)).sum())
        count += int(mask.sum())
    return total / max(count, 1)


def train(args) -> None:
    """On-policy distillation: each step the student samples a batch of multi-turn episodes, the
    per-turn streamer trains on them (teacher scoring each turn on its cache), one Adam step."""
    cfg = LearnerConfig.model_validate({
        "model": {"hf_checkpoint": args.hf},
        "precision": {"core_attention": "past_kv"},
        "optimizer": {"name": "adam", "lr": args.lr, "clip_grad": 1.0},
    })
    pgs = init_distributed(cfg)
    learner = MegatronLearner.build(cfg, OPDObjective(strategy=args.strategies.split(",")[0]), pgs)
    teacher = build_teacher(args.teacher_hf, cfg, pgs)
    seg = MegatronSegmentModel(learner.ddp, pgs)
    vocab = learner.model_cfg.vocab_size
    rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    held_out = [sample_episode(seg, torch.Generator().manual_seed(99), random.Random(99), vocab, 4) for _ in range(8)]
    curve, initial_fresh = [], reverse_kl(seg, teacher.model, held_out)
    for _ in range(args.steps):
        episodes = [sample_episode(seg, gen, rng, vocab, rng.randint(1, 6)) for _ in range(args.num_trajectories)]
        curve.append(reverse_kl(seg, teacher.model, episodes))
        streamer = opd_streamer(learner, teacher)
        stream(streamer, episodes, seed=rng.randrange(1000))
        finish_opd_stream(learner, streamer)
        learner.step()
    out = {"on_policy_kl": curve, "held_out_kl": (initial_fresh, reverse_kl(seg, teacher.model, held_out))}
    if pgs.rank == 0:
        torch.save(out, args.out)
    destroy_distributed()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["opd", "opd_grpo", "train"])
    p.add_argument("--out", required=True)
    p.add_argument("--hf", required=True)
    p.add_argument("--teacher-hf", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-trajectories", type=int, default=6)
    p.add_argument("--strategies", default="recompute,kv_adjoint,forward_early")
    p.add_argument("--aggregation", default="token_mean")
    p.add_argument("--divergence", default="reverse_kl")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-2)
    args = p.parse_args()
    {"opd": opd, "opd_grpo": opd_grpo, "train": train}[args.mode](args)


if __name__ == "__main__":
    main()
