"""Truncated importance sampling (TIS) between the rollout engine and the learner.

The rollout engine (vLLM) and the learner compute slightly different probabilities for the same
tokens (kernels, precision). TIS reweights each token's score term by
``w = min(pi_learner / pi_rollout, cap)``, per token or once per sequence, always detached. The
weights depend only on the trajectory and the current weights, so they are fixed the moment the
trajectory finishes and stream like any other per-token factor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def tis_weights(
    learner_logp: torch.Tensor,
    rollout_logp: torch.Tensor | None,
    mask: torch.Tensor,
    mode: str,
    cap: float,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """The detached weights per token; ``sequence_sum`` as in ``policy_surrogate`` (default: one
    sequence)."""
    if mode == "none":
        return None
    if rollout_logp is None:
        raise ValueError("tis: the trajectory has no rollout_logprobs")
    log_ratio = (learner_logp.detach() - rollout_logp).masked_fill(~mask, 0.0)
    if mode == "token":
        return log_ratio.exp().clamp(max=cap)
    if mode == "sequence":
        total = log_ratio.sum().expand_as(log_ratio) if sequence_sum is None else sequence_sum(log_ratio)
        return total.exp().clamp(max=cap)
    raise ValueError(f"unknown tis mode {mode!r}")
