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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megathunder.config import RLObjective
from megathunder.objectives.aggregation import sequence_weight
from megathunder.objectives.dapo import effective_loss_mask, filtered_as_overlong
from megathunder.objectives.importance import tis_weights
from megathunder.objectives.kl import kl_penalty
from megathunder.objectives.policy_loss import policy_surrogate
from megathunder.trajectory import Trajectory, loss_targets


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
    """``loss_i`` from the trajectory's log-probs (and entropies) at every target, [L-1]: the values
    at its loss-mask targets are what ``trajectories_loss`` reads."""
    at = traj.loss_mask.nonzero().squeeze(-1).to(logp_T.device)
    return trajectories_loss(logp_T[at], None if entropy_T is None else entropy_T[at], [traj], [spec], cfg,
                             None if old_logp_T is None else [old_logp_T])


def trajectories_loss(
    logp_N: torch.Tensor,
    entropy_N: torch.Tensor | None,
    trajs: Sequence[Trajectory],
    specs: Sequence[LossSpec],
    cfg: RLObjective,
    old_logps: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """``sum_i loss_i`` of several trajectories as one flat computation: ``logp_N`` (and
    ``entropy_N``) hold each trajectory's values at its loss-mask targets, in order, concatenated
    (the learner's output layer computes only those rows: ``learner.loss_logits_only``);
    ``old_logps``: each trajectory's PPO old log-probs at every target, [L-1] (None: ratio 1).

    One autograd node per operation for the whole micro-batch, not one per trajectory per
    operation (160 short trajectories made ~5,000 small nodes a pass). Why it is each trajectory's
    own ``loss_i``, token for token: every term is elementwise in the token, and what is per
    trajectory -- A_i, nu_i, the effective mask (DAPO's overlong filter), GSPO's sequence ratio and
    sequence-level TIS weights -- is a detached constant broadcast over the trajectory's own tokens,
    each sequence sum taken over that trajectory's values alone. So a token's gradient is computed
    by the same elementwise operations on the same operands however the trajectories are packed:
    packed and one-at-a-time backward passes give the same per-token gradients bit for bit."""
    on, dtype = logp_N.device, logp_N.dtype
    counts, at = loss_targets(trajs)
    if sum(counts) != logp_N.numel():
        raise ValueError(f"trajectories_loss: {logp_N.numel()} log-probs for {sum(counts)} loss targets")

    def per_token(values: Sequence[float]) -> torch.Tensor:  # one value per trajectory, over its tokens
        return torch.tensor(values, dtype=dtype).repeat_interleave(torch.tensor(counts)).to(on)

    def at_targets(rows: Sequence[torch.Tensor]) -> torch.Tensor:  # [L-1] rows -> their loss targets
        return torch.cat([row.to(on, dtype)[a.to(on)] for row, a in zip(rows, at, strict=True)])

    def sequence_sum(values_N: torch.Tensor) -> torch.Tensor:  # detached: each trajectory's sum, over its tokens
        sums = [part.sum() for part in values_N.detach().split(counts)]
        return torch.stack(sums).repeat_interleave(torch.tensor(counts, device=on)) if sums else values_N.detach()

    kept = [not filtered_as_overlong(t, cfg.overlong_filter) for t in trajs]
    mask = per_token([float(k) for k in kept]).bool()
    old_N = logp_N.detach()  # ratio 1: no PPO old log-probs
    if old_logps is not None and any(o is not None for o in old_logps):
        if any(o is None for o in old_logps):
            raise ValueError("trajectories_loss: PPO old log-probs for all of a pass's trajectories or none")
        old_N = at_targets(old_logps)
    terms = torch.zeros_like(logp_N)
    score = [s.advantage is not None for s in specs]
    if any(score):
        if not all(score):
            raise ValueError("trajectories_loss: one pass computes the score term for all its trajectories or none")
        advantage = per_token([float(s.advantage) for s in specs])  # type: ignore[arg-type]
        terms = policy_surrogate(logp_N, old_N, mask, advantage, cfg, sequence_sum)
        rollout = None
        if cfg.tis != "none":
            missing = [t.traj_id for t in trajs if t.rollout_logprobs is None]
            if missing:
                raise ValueError(f"tis: trajectories {missing[:5]} have no rollout_logprobs")
            rollout = at_targets([t.rollout_logprobs for t in trajs])
        weights = tis_weights(old_N, rollout, mask, cfg.tis, cfg.tis_cap, sequence_sum)
        if weights is not None:
            terms = terms * weights
    reward_free = [s.reward_free for s in specs]
    if any(reward_free):
        if not all(reward_free):
            raise ValueError("trajectories_loss: one pass computes the reward-free terms for all its trajectories or none")
        if cfg.kl_coef > 0:
            missing = [t.traj_id for t in trajs if t.ref_logprobs is None]
            if missing:
                raise ValueError(f"trajectory {missing[0]}: kl_coef > 0 needs ref_logprobs")
            ref = at_targets([t.ref_logprobs for t in trajs])
            terms = terms + cfg.kl_coef * kl_penalty(logp_N, ref, cfg.kl_estimator)
        if cfg.entropy_coef > 0:
            assert entropy_N is not None, "entropy_coef > 0 needs the entropy"
            terms = terms - cfg.entropy_coef * entropy_N
    if not terms.requires_grad and logp_N.requires_grad:
        # a reward-free pass without KL or entropy: the model's own reward-free terms (MoE router
        # losses) are all it adds; keep the loss on the graph so the backward reaches them
        terms = logp_N * 0.0
    nu = per_token([sequence_weight(n if k else 0, cfg) for n, k in zip(counts, kept, strict=True)])
    return (nu * torch.where(mask, terms, 0.0)).sum()
