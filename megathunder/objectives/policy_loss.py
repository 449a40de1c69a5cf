"""Policy-gradient surrogates per token: PPO-clip (with DAPO's clip-higher and dual clip), GSPO, CISPO.

All take ``ratio = exp(logp - old_logp)``. With one optimizer step per batch ``old_logp`` equals
``logp`` at the point where the gradient is taken, so ratio == 1, no clip is active, and every
surrogate has the same gradient, ``-A * grad logp``. That is what makes the score gradient linear
in the advantage, and streaming exact. ``old_logp`` defaults to ``logp.detach()`` (no extra
forward); PPO epochs and mini-batches (``megathunder.objectives.ppo``) pass the batch's old
logprobs, and the ratio, the clip and the dual clip then act.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megathunder.config import RLObjective


def policy_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    advantage: float | torch.Tensor,
    cfg: RLObjective,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per-token loss (to be minimised) of the score term. ``advantage``: one value, or one per
    token (several trajectories' tokens side by side); ``sequence_sum``: a detached tensor's sum
    over each token's own sequence, per token (default: the whole tensor is one sequence)."""
    log_ratio = logp - old_logp
    if cfg.policy_loss == "gspo":
        # Sequence-level ratio (geometric mean over loss tokens), applied per token with the token's
        # own gradient path: s_it = sg(s_i) * exp(logp_it - sg(logp_it)).
        total = sequence_sum or _whole
        n = total(mask.to(logp.dtype)).clamp(min=1)
        seq_log_ratio = total(log_ratio.detach().masked_fill(~mask, 0.0)) / n
        log_ratio = seq_log_ratio + logp - logp.detach()
    ratio = log_ratio.exp()
    if cfg.policy_loss == "cispo":
        weight = ratio.detach().clamp(max=1.0 + cfg.clip_eps_high)
        return -advantage * weight * logp
    clipped = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    loss = torch.maximum(-advantage * ratio, -advantage * clipped)
    if cfg.clip_ratio_c is not None:  # dual clip: for A < 0, bounded by -A * c
        if isinstance(advantage, torch.Tensor):
            loss = torch.where(advantage < 0, torch.minimum(loss, -advantage * cfg.clip_ratio_c), loss)
        elif advantage < 0:
            loss = torch.minimum(loss, torch.full_like(loss, -advantage * cfg.clip_ratio_c))
    return loss


def _whole(values: torch.Tensor) -> torch.Tensor:
    """The sum over one sequence, at each of its tokens."""
    return values.detach().sum().expand_as(values)
