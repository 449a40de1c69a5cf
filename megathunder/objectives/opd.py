"""On-policy distillation (OPD): per-token reverse KL to a teacher, as a policy-gradient advantage.

For a student sample y_t ~ pi(.|ctx) the per-token reverse-KL estimate is l_t - l^T_t (student
and teacher log-probabilities of the sampled token). Minimising its expectation gives the
gradient E[(l_t - l^T_t) grad l_t] (the score-function term; E[grad l_t] = 0), so each trained
token carries the detached coefficient

    c_t = beta * m_t * (l_t - l^T_t)         and the batch gradient is  (1/Z) sum_t c_t grad l_t

with Z the number of trained tokens in the batch (token_mean) or of trajectories
(seq_mean_token_sum). No group statistics: c_t is fixed the moment the teacher has scored token
t, i.e. when its turn completes -- which is why OPD streams per turn. ``seq_mean_token_mean``
would need the trajectory's total token count, known only when it ends, so it is not offered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

OPDAggregation = Literal["token_mean", "seq_mean_token_sum"]


def opd_coefficients(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """c_t (detached); zero where the mask is False."""
    return torch.where(mask, beta * (student_logp.detach() - teacher_logp), 0.0)


def opd_loss(student_logp: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """Unnormalised surrogate whose gradient is sum_t c_t grad l_t."""
    return (coefficients * student_logp).sum()


def opd_normaliser(num_trained_tokens: Sequence[int], aggregation: OPDAggregation) -> float:
    z = sum(num_trained_tokens) if aggregation == "token_mean" else len(num_trained_tokens)
    return float(max(z, 1))
