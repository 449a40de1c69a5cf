"""The reference itself: finite differences, surrogate equivalence at ratio 1, micro-batching."""

from __future__ import annotations

import pytest
import torch

from megathunder.config import GRPOObjective
from megathunder.objectives import LossSpec, token_logprobs_and_entropy, trajectory_loss
from megathunder.streaming.reference import batch_advantages, batch_loss, reference_gradient
from tests.helpers import make_case, rel_err, small_model


def _old_logps(model, batch):
    with torch.no_grad():
        return [
            token_logprobs_and_entropy(model(t.tokens[None])[0, :-1], t.tokens[1:], False)[0]
            for t in batch
        ]


@pytest.mark.parametrize(
    "objective",
    [
        GRPOObjective(advantage="grpo", kl_coef=0.1, kl_estimator="k3", entropy_coef=0.02),
        GRPOObjective(advantage="rloo", loss_agg="seq_mean_token_mean", kl_coef=0.1, kl_estimator="k1"),
        GRPOObjective(advantage="dr_grpo", tis="token", kl_coef=0.1, kl_estimator="k2"),
    ],
    ids=["grpo-k3-entropy", "rloo-k1", "drgrpo-tis-k2"],
)
def test_reference_matches_finite_differences(objective):
    """<grad, v> equals the central difference of the batch loss along a random direction v.

    The loss is a function of the weights with the old-policy logprobs (and so the TIS weights)
    held fixed at the evaluation point, as in training. PPO-clip only: GSPO-token and CISPO are
    defined through stop-gradients, so their loss value is not a potential of their gradient
    away from ratio 1 (their gradient is checked against -A grad logp below instead).
    """
    model = small_model("float64", seed=3)
    _, batch, rewards = make_case(11, torch.float64, "continuous")
    grad = reference_gradient(model, batch, rewards, objective)
    advantages, z = batch_advantages(batch, rewards, objective)
    kept = [i for i, a in enumerate(advantages) if a is not None]
    trajs = [batch[i] for i in kept]
    old = _old_logps(model, trajs)

    def loss_at(offset: torch.Tensor) -> float:
        params = list(model.parameters())
        saved = [p.detach().clone() for p in params]
        start = 0
        with torch.no_grad():
            for p in params:
                p.add_(offset[start : start + p.numel()].view_as(p))
                start += p.numel()
            value = batch_loss(model, trajs, [advantages[i] for i in kept], objective, old).item() / z
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
        return value

    gen = torch.Generator().manual_seed(0)
    v = torch.randn(grad.numel(), generator=gen, dtype=torch.float64)
    v /= v.norm()
    eps = 1e-5
    fd = (loss_at(eps * v) - loss_at(-eps * v)) / (2 * eps)
    analytic = torch.dot(grad, v).item()
    assert abs(fd - analytic) <= 1e-7 * max(1.0, abs(analytic)), (fd, analytic)


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "gspo", "cispo"])
def test_every_surrogate_has_gradient_minus_a_grad_logp_at_ratio_one(policy_loss):
    model = small_model("float64")
    _, batch, _ = make_case(12, torch.float64)
    traj = next(t for t in batch if t.loss_mask.any())
    cfg = GRPOObjective(policy_loss=policy_loss)
    logits = model(traj.tokens[None])[0, :-1]
    logp, _ = token_logprobs_and_entropy(logits, traj.tokens[1:], False)
    params = list(model.parameters())
    a = 0.7
    g_surrogate = torch.autograd.grad(
        trajectory_loss(logp, None, traj, LossSpec(advantage=a, reward_free=False), cfg),
        params, retain_graph=True,
    )
    g_direct = torch.autograd.grad(-a * logp[traj.loss_mask].sum(), params)
    for x, y in zip(g_surrogate, g_direct, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)


def test_micro_batching_does_not_change_the_reference():
    model = small_model("float64")
    _, batch, rewards = make_case(13, torch.float64)
    objective = GRPOObjective(kl_coef=0.05, entropy_coef=0.01)
    full = reference_gradient(model, batch, rewards, objective)
    for mbs in (1, 3):
        assert rel_err(reference_gradient(model, batch, rewards, objective, micro_batch_size=mbs), full) <= 1e-12
    for pack in (0, 20, 60):  # learner.pack_tokens' grouping: rows x longest <= pack
        assert rel_err(reference_gradient(model, batch, rewards, objective, pack_tokens=pack), full) <= 1e-12
