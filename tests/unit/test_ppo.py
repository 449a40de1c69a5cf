"""PPO epochs and mini-batches: the update against the published formulas, written out here.

``reference_ppo_update`` (the function the Megatron learner is tested against) runs a batch as E
epochs x M mini-batches of optimizer steps with old logprobs fixed once. The independent version
below follows the PPO / GRPO papers and verl's documented loss directly -- per-token advantages
(r - mean_g) / (std_g + eps) (unbiased std), ratio exp(l - l_old), the clipped surrogate
max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), dual clip min(., -A c) where A < 0, the
mini-batch's token-mean -- on padded tensors, no project code in the loss. fp64, SGD: the
parameters after a batch are the start minus lr times a sum of gradients, so comparing them
compares the gradients (1e-10 relative).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from megathunder.config import GRPOObjective
from megathunder.objectives.ppo import minibatches, update_plan
from megathunder.streaming import synthetic as syn
from megathunder.streaming.reference import reference_ppo_update
from tests.helpers import MAX_LEN, VOCAB, rel_err, small_model

LR = 2.0  # large on purpose: after the first step many ratios leave [1 - eps, 1 + eps]


def _case(seed: int, rollout_noise: float = 0.0, model=None):
    rng = random.Random(seed)
    batch = syn.random_batch(rng, [4, 4, 4, 4], VOCAB, MAX_LEN, torch.float64, empty_prob=0.0)
    for t in batch:
        t.truncated = False
    rewards = syn.random_rewards(rng, batch, "continuous")
    if model is not None:  # behaviour logprobs: the model's own, perturbed (an older policy)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for t in batch:
                logits = model(t.tokens[None])[0, :-1]
                logp = torch.log_softmax(logits, -1).gather(-1, t.tokens[1:, None])[:, 0]
                t.rollout_logprobs = logp + rollout_noise * torch.randn(logp.shape, generator=gen, dtype=logp.dtype)
    return batch, rewards


def _published_ppo(model, batch, rewards, *, epochs, num_mb, eps_low, eps_high, clip_c, old_from_rollout, lr):
    """The textbook loop; returns per-step (clipped share, dual-clipped share, min distance of a
    ratio to a clip boundary)."""
    r = torch.tensor(rewards, dtype=torch.float64)
    gid = torch.tensor([t.group_id for t in batch])
    adv = torch.empty_like(r)
    for g in gid.unique():
        sel = gid == g
        adv[sel] = (r[sel] - r[sel].mean()) / (r[sel].std() + 1e-6)
    length = max(t.tokens.numel() for t in batch)
    tokens = torch.zeros(len(batch), length, dtype=torch.long)
    mask = torch.zeros(len(batch), length - 1, dtype=torch.bool)
    for i, t in enumerate(batch):
        tokens[i, : t.tokens.numel()] = t.tokens
        mask[i, : t.loss_mask.numel()] = t.loss_mask

    def logprobs(rows):
        logits = model(tokens[rows])[:, :-1]
        return torch.log_softmax(logits, -1).gather(-1, tokens[rows, 1:, None])[..., 0]

    if old_from_rollout:
        old = torch.zeros(len(batch), length - 1, dtype=torch.float64)
        for i, t in enumerate(batch):
            old[i, : t.rollout_logprobs.numel()] = t.rollout_logprobs
    else:
        with torch.no_grad():
            old = logprobs(torch.arange(len(batch)))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    size = len(batch) // num_mb
    stats = []
    for _ in range(epochs):
        for k in range(num_mb):
            rows = torch.arange(k * size, (k + 1) * size)
            m, a = mask[rows], adv[rows, None]
            ratio = torch.exp(logprobs(rows) - old[rows])
            pg1 = -a * ratio
            pg2 = -a * ratio.clamp(1 - eps_low, 1 + eps_high)
            clip1 = torch.maximum(pg1, pg2)
            pg = clip1 if clip_c is None else torch.where(a < 0, torch.minimum(clip1, -a * clip_c), clip1)
            loss = (pg * m).sum() / m.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            rd = ratio.detach()
            clipped = ((rd < 1 - eps_low) & (a < 0) | (rd > 1 + eps_high) & (a > 0)) & m
            dual = (rd > clip_c) & (a < 0) & m if clip_c is not None else torch.zeros_like(m)
            bounds = [1 - eps_low, 1 + eps_high] + ([clip_c] if clip_c is not None else [])
            gap = min((rd[m] - b).abs().min().item() for b in bounds)
            stats.append((clipped.sum().item() / m.sum().item(), dual.sum().item() / m.sum().item(), gap))
    return stats


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("epochs,num_mb", [(2, 2), (3, 1), (1, 4)])
@pytest.mark.parametrize("old_from", ["learner", "rollout"])
def test_ppo_epochs_and_minibatches_equal_the_published_loop(epochs, num_mb, old_from):
    base = small_model("float64", seed=5)
    batch, rewards = _case(7, rollout_noise=0.3, model=base)
    clip_c = 1.5
    cfg = GRPOObjective(num_ppo_epochs=epochs, num_minibatches_per_batch=num_mb, clip_eps_low=0.05,
                        clip_eps_high=0.08, clip_ratio_c=clip_c, ppo_old_logprobs=old_from)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    steps = reference_ppo_update(ours, torch.optim.SGD(ours.parameters(), lr=LR), batch, rewards, cfg)
    stats = _published_ppo(theirs, batch, rewards, epochs=epochs, num_mb=num_mb, eps_low=0.05, eps_high=0.08,
                           clip_c=clip_c, old_from_rollout=old_from == "rollout", lr=LR)
    assert steps == epochs * num_mb == len(stats)
    start = _flat(base)
    assert rel_err(_flat(ours) - start, _flat(theirs) - start) <= 1e-10
    # The comparison is about the clipped regime, and no ratio sits on a boundary (where fp64
    # rounding could pick the other branch).
    if epochs * num_mb > 1 or old_from == "rollout":
        assert max(s[0] for s in stats) > 0.05, stats
    assert min(s[2] for s in stats) > 1e-9, stats
    if old_from == "rollout":
        assert max(s[1] for s in stats) > 0, stats  # the dual clip bound some token


def test_one_update_with_learner_old_logprobs_is_the_plain_gradient_step():
    """E = M = 1: ratio 1 everywhere, so the update is one step along the batch gradient."""
    from megathunder.streaming.reference import reference_gradient

    base = small_model("float64", seed=5)
    batch, rewards = _case(8)
    cfg = GRPOObjective(clip_eps_low=0.05, clip_eps_high=0.08, clip_ratio_c=1.5)
    ours = copy.deepcopy(base)
    reference_ppo_update(ours, torch.optim.SGD(ours.parameters(), lr=LR), batch, rewards, cfg)
    grad = reference_gradient(base, batch, rewards, cfg)
    assert rel_err(_flat(ours) - _flat(base), -LR * grad) <= 1e-12


def test_minibatches_are_contiguous_and_as_equal_as_possible():
    assert minibatches(list(range(10)), 3) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert minibatches(list(range(2)), 4) == [[0], [1]]
    assert minibatches([], 2) == []
    cfg = GRPOObjective(num_ppo_epochs=2, num_minibatches_per_batch=2)
    assert update_plan([3, 5, 8], cfg) == [[3, 5], [8], [3, 5], [8]]
    assert update_plan([], cfg) == [[], []]


def test_dual_clip_bounds_the_negative_advantage_loss():
    from megathunder.objectives.policy_loss import policy_surrogate

    cfg = GRPOObjective(clip_ratio_c=3.0)
    logp = torch.log(torch.tensor([0.5, 1.0, 2.0, 10.0], dtype=torch.float64))
    mask = torch.ones(4, dtype=torch.bool)
    loss = policy_surrogate(logp, torch.zeros(4, dtype=torch.float64), mask, -1.0, cfg)
    assert loss.tolist() == pytest.approx([0.8, 1.0, 2.0, 3.0])  # max(r, clip(r)) then min(., c)
    plain = policy_surrogate(logp, torch.zeros(4, dtype=torch.float64), mask, -1.0, GRPOObjective())
    assert plain[-1].item() == pytest.approx(10.0)
    pos = policy_surrogate(logp, torch.zeros(4, dtype=torch.float64), mask, 1.0, cfg)
    assert pos.tolist() == pytest.approx([-0.5, -1.0, -1.28, -1.28])  # no dual clip for A > 0
