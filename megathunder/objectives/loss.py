"""One trajectory's loss: the single function both the batch reference and the streaming path call.

For trajectory i with effective loss mask m, nu_i from the aggregation mode and detached TIS
weights w, the unnormalised loss is

    loss_i(A, rf) = nu_i * sum_t m_t * [ surrogate_t(A) * w_t  +  rf * (beta * kl_t - alpha * H_t) ]

whose gradient at ratio 1 is ``-A * h_i + rf * q_i`` (docs/exactness.md, section 1). ``advantage=None``
leaves the score term out and ``reward_free=False`` the KL/entropy terms (and a MoE model's router
losses, whose weight ``router_loss_weight`` gives), so the ledger can ask
for h_i alone (A = -1), q_i alone, or both combined in one backward when the coefficients are
known. The batch loss is ``(1/Z) * sum_i loss_i(A_i, keep_g)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megathunder.config import RLObjective
from megathunder.objectives.aggregation import sequence_weight
from megathunder.objectives.dapo import effective_loss_mask
from megathunder.objectives.importance import tis_weights
from megathunder.objectives.kl import kl_penalty
from megathunder.objectives.policy_loss import policy_surrogate
from megathunder.trajectory import Trajectory


@dataclass(frozen=True)
class LossSpec:
    """Which terms of ``loss_i`` one backward pass computes."""

    advantage: float | None  # coefficient of the score term; None: leave it out
    reward_free: bool  # include the KL / entropy terms

    def __post_init__(self) -> None:
        if self.advantage is None and not self.reward_free:
            raise ValueError("LossSpec selects no term")


def token_logprobs_and_entropy(
    logits_TV: torch.Tensor, targets_T: torch.Tensor, need_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``targets`` under ``logits`` and, if asked, the per-position entropy."""
    logprobs_TV = torch.log_softmax(logits_TV, dim=-1)
    logp_T = logprobs_TV.gather(-1, targets_T.unsqueeze(-1)).squeeze(-1)
    entropy_T = -(logprobs_TV.exp() * logprobs_TV).sum(-1) if need_entropy else None
    return logp_T, entropy_T


def num_loss_tokens(traj: Trajectory, cfg: RLObjective) -> int:
    return int(effective_loss_mask(traj, cfg.overlong_filter).sum())


def router_loss_weight(traj: Trajectory, spec: LossSpec, cfg: RLObjective) -> float:
    """The weight w_i of trajectory i's MoE router losses in a pass computing ``spec``: nu_i x its
    loss tokens in a reward-free pass (the losses weighted as if spread over its loss tokens, as
    the KL term is; the batch divides by Z once), 0 in a score-only pass
    (``megathunder.learner.router_losses``)."""
    if not spec.reward_free:
        return 0.0
    n = num_loss_tokens(traj, cfg)
    return sequence_weight(n, cfg) * n


def trajectory_loss(
    logp_T: torch.Tensor,
    entropy_T: torch.Tensor | None,
    traj: Trajectory,
    spec: LossSpec,
    cfg: RLObjective,
    old_logp_T: torch.Tensor | None = None,
) -> torch.Tensor:
    on = logp_T.device  # trajectories live on the host; the logprobs where the model runs
    mask = effective_loss_mask(traj, cfg.overlong_filter).to(on)
    old_logp_T = logp_T.detach() if old_logp_T is None else old_logp_T.to(logp_T)
    per_token = torch.zeros_like(logp_T)
    if spec.advantage is not None:
        per_token = policy_surrogate(logp_T, old_logp_T, mask, spec.advantage, cfg)
        rollout = None if traj.rollout_logprobs is None else traj.rollout_logprobs.to(logp_T)
        weights = tis_weights(old_logp_T, rollout, mask, cfg.tis, cfg.tis_cap)
        if weights is not None:
            per_token = per_token * weights
    if spec.reward_free:
        if cfg.kl_coef > 0:
            if traj.ref_logprobs is None:
                raise ValueError(f"trajectory {traj.traj_id}: kl_coef > 0 needs ref_logprobs")
            per_token = per_token + cfg.kl_coef * kl_penalty(logp_T, traj.ref_logprobs.to(logp_T), cfg.kl_estimator)
        if cfg.entropy_coef > 0:
            assert entropy_T is not None, "entropy_coef > 0 needs the entropy"
            per_token = per_token - cfg.entropy_coef * entropy_T
    if not per_token.requires_grad and logp_T.requires_grad:
        # a reward-free pass without KL or entropy: the model's own reward-free terms (MoE router
        # losses) are all it adds; keep the loss on the graph so the backward reaches them
        per_token = logp_T * 0.0
    nu = sequence_weight(int(mask.sum()), cfg)
    return nu * torch.where(mask, per_token, 0.0).sum()
