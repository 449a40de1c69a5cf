"""The objective library. Each function is used unchanged by the batch reference and the ledger."""

from megathunder.objectives.advantages import (
    GroupStats,
    advantage,
    batch_divisor,
    coef_known_before_close,
    group_stats,
    keeps_group,
    size_coef,
)
from megathunder.objectives.aggregation import normaliser, sequence_weight
from megathunder.objectives.dapo import effective_loss_mask
from megathunder.objectives.loss import (
    LossSpec,
    num_loss_tokens,
    router_loss_weight,
    token_logprobs_and_entropy,
    trajectories_loss,
    trajectory_loss,
)

__all__ = [
    "GroupStats",
    "LossSpec",
    "advantage",
    "batch_divisor",
    "coef_known_before_close",
    "effective_loss_mask",
    "group_stats",
    "keeps_group",
    "normaliser",
    "num_loss_tokens",
    "router_loss_weight",
    "sequence_weight",
    "size_coef",
    "token_logprobs_and_entropy",
    "trajectories_loss",
    "trajectory_loss",
]
