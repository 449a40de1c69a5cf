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

The GKD-style generalized Jensen-Shannon divergence is the alternative per-token divergence
(``gjsd_terms``): with M = lam P_T + (1 - lam) P_S over the vocabulary,

    JSD_lam(P_T || P_S) = lam KL(P_T || M) + (1 - lam) KL(P_S || M)

a direct function of the student's logits at each trained position (on student-sampled contexts,
whose sampling is not differentiated, as in GKD); it needs the teacher's whole distribution, so a
teacher that only returns sampled-token logprobs (vLLM prompt logprobs) cannot serve it. It is a
per-token term like the reverse KL, so it streams per turn the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megathunder.config import OPDAggregation


def opd_coefficients(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """c_t (detached); zero where the mask is False."""
    return torch.where(mask, beta * (student_logp.detach() - teacher_logp), 0.0)


def opd_loss(student_logp: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """Unnormalised surrogate whose gradient is sum_t c_t grad l_t."""
    return (coefficients * student_logp).sum()


def gjsd_terms(student_logp_V: torch.Tensor, teacher_logp_V: torch.Tensor, lam: float) -> torch.Tensor:
    """Per-vocabulary-entry terms of JSD_lam, [n, V] (or this rank's slice of V): summed over the
    vocabulary (across tensor-parallel ranks) they give each position's divergence. Inputs are
    normalised log-probabilities; the teacher's are constants."""
    if not 0.0 < lam < 1.0:
        raise ValueError(f"gjsd: lam must lie in (0, 1), got {lam}")
    teacher = teacher_logp_V.detach()
    log_m = torch.logaddexp(teacher + math.log(lam), student_logp_V + math.log(1.0 - lam))
    return lam * teacher.exp() * (teacher - log_m) + (1.0 - lam) * student_logp_V.exp() * (student_logp_V - log_m)


def opd_normaliser(num_trained_tokens: Sequence[int], aggregation: OPDAggregation) -> float:
    z = sum(num_trained_tokens) if aggregation == "token_mean" else len(num_trained_tokens)
    return float(max(z, 1))
