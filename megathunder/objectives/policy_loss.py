"""Policy-gradient surrogates per token: PPO-clip (with DAPO's clip-higher and dual clip), GSPO, CISPO.

All take ``ratio = exp(logp - old_logp)``. With one optimizer step per batch ``old_logp`` equals
``logp`` at the point where the gradient is taken, so ratio == 1, no clip is active, and every
surrogate has the same gradient, ``-A * grad logp``. That is what makes the score gradient linear
in the advantage, and streaming exact. ``old_logp`` defaults to ``logp.detach()`` (no extra
forward); PPO epochs and mini-batches (``megathunder.objectives.ppo``) pass the batch's old
logprobs, and the ratio, the clip and the dual clip then act.
"""

from __future__ import annotations

import torch

from megathunder.config import RLObjective


def policy_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    advantage: float,
    cfg: RLObjective,
) -> torch.Tensor:
    """Per-token loss (to be minimised) of the score term."""
    log_ratio = logp - old_logp
    if cfg.policy_loss == "gspo":
        # Sequence-level ratio (geometric mean over loss tokens), applied per token with the token's
        # own gradient path: s_it = sg(s_i) * exp(logp_it - sg(logp_it)).
        n = mask.sum().clamp(min=1)
        seq_log_ratio = log_ratio.detach().masked_fill(~mask, 0.0).sum() / n
        log_ratio = seq_log_ratio + logp - logp.detach()
    ratio = log_ratio.exp()
    if cfg.policy_loss == "cispo":
        weight = ratio.detach().clamp(max=1.0 + cfg.clip_eps_high)
        return -advantage * weight * logp
    clipped = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    loss = torch.maximum(-advantage * ratio, -advantage * clipped)
    if cfg.clip_ratio_c is not None and advantage < 0:  # dual clip: bounded by -A * c
        loss = torch.minimum(loss, torch.full_like(loss, -advantage * cfg.clip_ratio_c))
    return loss
