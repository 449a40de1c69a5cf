"""The objective library's functions against their textbook definitions."""

from __future__ import annotations

import math

import pytest
import torch

from megathunder.config import GRPOObjective
from megathunder.objectives import (
    advantage,
    batch_divisor,
    group_stats,
    keeps_group,
    normaliser,
    sequence_weight,
)
from megathunder.objectives.importance import tis_weights
from megathunder.objectives.kl import kl_penalty

REWARDS = [0.3, 1.0, -2.0, 0.5, 0.5]


def test_grpo_advantages_match_torch_mean_and_std():
    cfg = GRPOObjective(advantage="grpo", std_eps=1e-6)
    stats = group_stats(REWARDS, cfg)
    r = torch.tensor(REWARDS, dtype=torch.float64)
    expected = (r - r.mean()) / (r.std() + 1e-6)
    got = torch.tensor([advantage(x, stats) for x in REWARDS], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-14)


def test_rloo_is_the_leave_one_out_baseline():
    cfg = GRPOObjective(advantage="rloo")
    stats = group_stats(REWARDS, cfg)
    for i, x in enumerate(REWARDS):
        others = REWARDS[:i] + REWARDS[i + 1 :]
        assert advantage(x, stats) == pytest.approx(x - sum(others) / len(others), abs=1e-14)
    assert advantage(3.0, group_stats([3.0], cfg)) == 0.0


def test_dr_grpo_has_no_std_and_batch_std_uses_the_batch():
    dr = GRPOObjective(advantage="dr_grpo")
    assert advantage(1.0, group_stats(REWARDS, dr)) == pytest.approx(1.0 - sum(REWARDS) / 5)
    bs = GRPOObjective(advantage="batch_std", std_eps=1e-12)
    centered = [1.0, -1.0, 2.0, -2.0]
    assert batch_divisor(centered, bs) == pytest.approx(torch.tensor(centered).std().item())
    assert batch_divisor(centered, dr) == 1.0


def test_group_of_equal_rewards_has_exact_zero_statistics():
    for value in (0.1, 1e4 + 0.3, -7.77):
        stats = group_stats([value] * 7, GRPOObjective())
        assert stats.mean == value and stats.std == 0.0
        assert advantage(value, stats) == 0.0


def test_dapo_keeps_only_groups_with_signal():
    on = GRPOObjective(dapo_dynamic_sampling=True)
    assert not keeps_group([1.0, 1.0, 1.0], on)
    assert keeps_group([1.0, 0.0, 1.0], on)
    assert keeps_group([1.0, 1.0], GRPOObjective())


@pytest.mark.parametrize(
    "mode,expected_z,expected_nu",
    [
        ("token_mean", 15.0, 1.0),
        ("seq_mean_token_sum", 3.0, 1.0),
        ("seq_mean_token_mean", 3.0, 1 / 5),
        ("seq_mean_token_sum_norm", 3.0 * 8, 1.0),
    ],
)
def test_aggregation(mode, expected_z, expected_nu):
    cfg = GRPOObjective(loss_agg=mode, loss_agg_norm_tokens=8)
    assert normaliser([5, 10, 0], cfg) == expected_z
    assert sequence_weight(5, cfg) == expected_nu
    assert normaliser([], cfg) == 1.0  # an empty (all-dropped) batch divides by 1, not 0


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    d = ref - logp
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), -d)
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), 0.5 * d**2)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), d.exp() - d - 1)
    assert kl_penalty(logp, ref, "k3").min() >= 0
    # Clamps: a huge log-ratio stays finite and bounded.
    big = kl_penalty(torch.tensor([0.0]), torch.tensor([100.0]), "k3")
    assert big.item() == 10.0


def test_tis_weights():
    learner = torch.tensor([-1.0, -1.0, -3.0])
    rollout = torch.tensor([-1.5, -0.5, -1.0])
    mask = torch.tensor([True, True, False])
    tok = tis_weights(learner, rollout, mask, "token", cap=1.5)
    torch.testing.assert_close(tok[:2], torch.tensor([1.5, math.exp(-0.5)]))
    seq = tis_weights(learner, rollout, mask, "sequence", cap=5.0)
    torch.testing.assert_close(seq, torch.full((3,), 1.0))
    assert tis_weights(learner, rollout, mask, "none", cap=1.0) is None


@pytest.mark.parametrize("advantage,expected", [("grpo", 2.5 / (1 + 1e-6)), ("dr_grpo", 2.5), ("rloo", 2.5)])
def test_singleton_group_conventions(advantage, expected):
    """A group of one: 0 by default; verl's raw score (mean 0, std 1) when asked."""
    zero = GRPOObjective(advantage=advantage)
    assert advantage_of_lone(2.5, zero) == 0.0
    verl = GRPOObjective(advantage=advantage, singleton_group="raw_score")
    assert advantage_of_lone(2.5, verl) == pytest.approx(expected, rel=1e-15)


def advantage_of_lone(reward: float, cfg) -> float:
    from megathunder.objectives import advantage, group_stats

    return advantage(reward, group_stats([reward], cfg))
