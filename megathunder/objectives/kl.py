"""KL-to-reference estimators per token (Schulman's k1, k2, k3), as differentiable loss terms.

With ``delta = logp_ref - logp``:
    k1 = -delta                       (unbiased, high variance)
    k2 = 0.5 * delta ** 2
    k3 = exp(delta) - delta - 1       (low_var_kl: unbiased, non-negative), computed with delta
                                      clamped to [-20, 20] and the result to [-10, 10]
The clamps match common practice (verl's low_var_kl); inside them the gradient is exact.
"""

from __future__ import annotations

import torch


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    delta = ref_logp - logp
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        delta = delta.clamp(-20.0, 20.0)
        return (delta.exp() - delta - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl estimator {estimator!r}")
