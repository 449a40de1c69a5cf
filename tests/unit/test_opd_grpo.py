"""OPD + GRPO: KL part streamed per turn, reward part through the ledger's group slots, equals the
batch gradient of the combined loss (fp64, small torch decoder, <= 1e-10 relative)."""

from __future__ import annotations

import random

import pytest
import torch

from megathunder.streaming import synthetic as syn

from megathunder.trajectory import batch_plan
from megathunder.config import GRPOObjective, LedgerConfig
from megathunder.objectives import LossSpec, trajectory_loss
from megathunder.objectives.opd import opd_coefficients, opd_loss
from megathunder.streaming.reference import batch_advantages
from megathunder.streaming import TorchBackend
from megathunder.streaming.opd_grpo import OPDWithRewards
from megathunder.streaming.opd_turns import FunctionTeacher, TorchSegmentModel, _logp_of
from megathunder.trajectory import Trajectory
from tests.helpers import VOCAB, rel_err, small_model
from tests.opd_helpers import feed_parts, flatten, interleaved, random_episode
from tests.unit.test_opd_turns import _teacher_fn

BETA = 0.6


def _batch(seed: int):
    rng = random.Random(seed)
    episodes, batch = [], []
    for gid in range(3):
        for _ in range(3):
            parts = random_episode(rng, VOCAB)
            while len(flatten(parts)[0]) < 2:
                parts = random_episode(rng, VOCAB)
            tokens, mask = flatten(parts)
            batch.append(Trajectory(len(batch), gid, tokens, mask))
            episodes.append(parts)
    rewards = syn.random_rewards(rng, batch, rng.choice(["binary", "continuous"]))
    return rng, episodes, batch, rewards


def _reference(model, batch, rewards, objective, score) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    advantages, z = batch_advantages(batch, rewards, objective)
    for t, a in zip(batch, advantages, strict=True):
        logp = _logp_of(model(t.tokens[None])[0, :-1], t.tokens[1:])
        teacher = score(t.tokens, 1, t.tokens.numel())
        loss = opd_loss(logp, opd_coefficients(logp, teacher, t.loss_mask, BETA))
        loss = loss + trajectory_loss(logp, None, t, LossSpec(advantage=a, reward_free=False), objective)
        loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]) / z
    model.zero_grad(set_to_none=True)
    return grad


@pytest.mark.parametrize("strategy", ["recompute", "kv_adjoint", "forward_early"])
@pytest.mark.parametrize("advantage,loss_agg,slots", [("grpo", "token_mean", 1), ("rloo", "seq_mean_token_sum", None),
                                                      ("grpo", "seq_mean_token_sum", 0)])
def test_opd_kl_per_turn_plus_grpo_through_the_ledger_equals_batch(strategy, advantage, loss_agg, slots):
    objective = GRPOObjective(advantage=advantage, loss_agg=loss_agg)
    student, teacher = small_model("float64", seed=0), small_model("float64", seed=7)
    score = _teacher_fn(teacher)
    for seed in range(3):
        rng, episodes, batch, rewards = _batch(seed)
        reference = _reference(student, batch, rewards, objective, score)
        backend = TorchBackend(student, objective)
        combo = OPDWithRewards(backend, TorchSegmentModel(student), FunctionTeacher(score), objective,
                               LedgerConfig(max_group_slots=slots), beta=BETA, strategy=strategy)
        combo.begin_batch(batch_plan(batch))
        for t, parts in zip(batch, episodes, strict=True):
            combo.begin_trajectory(t.traj_id, parts[0][1])
        num_parts = {t.traj_id: len(episodes[t.traj_id]) - 1 for t in batch}
        for kind, tid, k in interleaved(num_parts, rng, rewards=True):  # turns, ends, rewards
            if kind == "part":
                feed_parts(combo, tid, episodes[tid][1 + k])
            elif kind == "end":
                combo.end_trajectory(batch[tid])
            else:
                combo.on_reward(tid, rewards[tid])
        combo.close_batch()
        streamed = backend.live.flat().clone()
        assert reference.norm() > 0
        assert rel_err(streamed, reference) <= 1e-10, (seed, strategy)


def test_combination_rejects_what_it_cannot_stream():
    student = small_model("float64")
    objective = GRPOObjective(loss_agg="seq_mean_token_mean")
    with pytest.raises(ValueError, match="loss_agg"):
        OPDWithRewards(TorchBackend(student, objective), TorchSegmentModel(student),
                       FunctionTeacher(lambda *a: None), objective)
