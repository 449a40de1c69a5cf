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


def test_dapo_singletons_are_dropped_or_kept_as_verl_keeps_them():
    """A group of one has all its rewards equal, trivially: dropped by default, kept with
    ``dapo_singletons: keep`` (verl's DAPO recipe keeps groups of one); larger groups as before."""
    drop = GRPOObjective(dapo_dynamic_sampling=True)
    keep = GRPOObjective(dapo_dynamic_sampling=True, dapo_singletons="keep")
    assert not keeps_group([1.0], drop) and keeps_group([1.0], keep)
    assert not keeps_group([1.0, 1.0], keep) and keeps_group([1.0, 0.0], keep)


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


# ------------------------------------------------------------- several trajectories, one flat loss

FLAT_OBJECTIVES = {
    "grpo": {},
    "dual_clip_ppo_epochs": {"clip_ratio_c": 3.0, "clip_eps_low": 0.1, "clip_eps_high": 0.12},
    "cispo": {"policy_loss": "cispo"},
    "gspo": {"policy_loss": "gspo"},
    "tis_token_kl_entropy": {"tis": "token", "tis_cap": 1.5, "kl_coef": 0.1, "entropy_coef": 0.01},
    "tis_sequence_seq_mean": {"tis": "sequence", "tis_cap": 3.0, "loss_agg": "seq_mean_token_mean"},
    "overlong_filter": {"overlong_filter": True, "kl_coef": 0.1, "kl_estimator": "k2"},
}


def _flat_case(seed: int):
    """Trajectories of different lengths, their loss masks with gaps (multi-turn), one truncated;
    full-length fp64 log-probs, entropies and PPO old log-probs (ratios away from 1)."""
    from megathunder.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed)
    trajs, logps, ents, olds = [], [], [], []
    for i, length in enumerate([7, 12, 3, 20, 9]):
        mask = torch.rand(length, generator=g) < 0.6
        mask[-1] = True
        mask[0] = False
        trajs.append(Trajectory(i, i // 2, torch.randint(0, 50, (length + 1,), generator=g), mask,
                                rollout_logprobs=-torch.rand(length, generator=g, dtype=torch.float64),
                                ref_logprobs=-torch.rand(length, generator=g, dtype=torch.float64),
                                truncated=i == 3))
        logps.append(-torch.rand(length, generator=g, dtype=torch.float64))
        ents.append(torch.rand(length, generator=g, dtype=torch.float64))
        olds.append(logps[-1] + 0.3 * torch.randn(length, generator=g, dtype=torch.float64))
    return trajs, logps, ents, olds


@pytest.mark.parametrize("name", list(FLAT_OBJECTIVES))
@pytest.mark.parametrize("ppo_old", [False, True], ids=["ratio1", "old_logprobs"])
def test_several_trajectories_flat_give_each_token_its_own_trajectorys_gradient_bit_for_bit(name, ppo_old):
    """``trajectories_loss`` (the learner's packed micro-batch: one flat computation over the
    trajectories' loss targets) against each trajectory's ``trajectory_loss`` alone: the same
    per-token gradients bit for bit, and the same loss to rounding. This is what lets a packed
    pass stand in for one-at-a-time passes in the streamed == batch proofs."""
    from megathunder.objectives import LossSpec, trajectories_loss, trajectory_loss

    cfg = GRPOObjective(**FLAT_OBJECTIVES[name])
    trajs, logps, ents, olds = _flat_case(7)
    specs = [LossSpec(advantage=a, reward_free=True) for a in (0.7, -1.3, 0.0, 2.1, -0.4)]
    old = olds if ppo_old else None

    leaves = [lp.clone().requires_grad_() for lp in logps]
    at = [t.loss_mask.nonzero().squeeze(-1) for t in trajs]
    packed = trajectories_loss(torch.cat([lp[a] for lp, a in zip(leaves, at)]),
                               torch.cat([e[a] for e, a in zip(ents, at)]), trajs, specs, cfg, old)
    packed.backward()

    alone = []
    for i, t in enumerate(trajs):
        leaf = logps[i].clone().requires_grad_()
        loss = trajectory_loss(leaf, ents[i], t, specs[i], cfg, None if old is None else old[i])
        loss.backward()
        alone.append(loss.detach())
        assert torch.equal(leaves[i].grad, leaf.grad), f"trajectory {i}"
        assert not leaf.grad[~t.loss_mask].any()  # nothing off the loss targets
    assert packed.item() == pytest.approx(float(sum(alone)), rel=1e-14)
    if cfg.overlong_filter:
        assert not leaves[3].grad.any()  # the truncated trajectory is filtered out whole


def test_the_flat_loss_at_ratio_one_has_the_textbook_score_gradient():
    """At ratio 1 (one optimizer step per batch) every surrogate's gradient is -A_i nu_i w_t at each
    loss target (w: the token TIS weight), independently of how the loss is written."""
    from megathunder.objectives import LossSpec, trajectories_loss

    cfg = GRPOObjective(tis="token", tis_cap=1.5, loss_agg="seq_mean_token_mean")
    trajs, logps, _, _ = _flat_case(11)
    advantages = [0.7, -1.3, 0.0, 2.1, -0.4]
    at = [t.loss_mask.nonzero().squeeze(-1) for t in trajs]
    flat = torch.cat([lp[a] for lp, a in zip(logps, at)]).requires_grad_()
    trajectories_loss(flat, None, trajs, [LossSpec(advantage=a, reward_free=False) for a in advantages],
                      cfg).backward()
    expected = []
    for t, a, lp, pos in zip(trajs, advantages, logps, at):
        w = (lp[pos] - t.rollout_logprobs[pos]).exp().clamp(max=1.5)
        expected.append(-a / pos.numel() * w)
    torch.testing.assert_close(flat.grad, torch.cat(expected), rtol=1e-14, atol=0)


def test_the_flat_loss_refuses_log_probs_that_do_not_match_the_loss_targets():
    from megathunder.objectives import LossSpec, trajectories_loss

    trajs, logps, _, _ = _flat_case(3)
    with pytest.raises(ValueError, match="log-probs for .* loss targets"):
        trajectories_loss(torch.cat(logps), None, trajs, [LossSpec(advantage=1.0, reward_free=False)] * 5,
                          GRPOObjective())
