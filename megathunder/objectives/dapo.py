"""DAPO's length handling: overlong filtering (a loss mask) and soft overlong punishment (a reward).

Dynamic sampling, DAPO's third trick, is a group decision: ``advantages.keeps_group``.
"""

from __future__ import annotations

import torch

from megathunder.trajectory import Trajectory


def effective_loss_mask(traj: Trajectory, overlong_filter: bool) -> torch.Tensor:
    """The trained targets: the trajectory's loss mask, all False if it is filtered as overlong."""
    if overlong_filter and traj.truncated:
        return torch.zeros_like(traj.loss_mask)
    return traj.loss_mask


def soft_overlong_penalty(response_len: int, max_response_len: int, buffer_len: int) -> float:
    """Reward shaping for responses inside the last ``buffer_len`` tokens before the limit.

    0 up to ``max_response_len - buffer_len``, then linear down to -1 at ``max_response_len``,
    -1 beyond. Add it to the task reward before the reward event is sent.
    """
    if buffer_len <= 0:
        raise ValueError("soft_overlong_penalty: buffer_len must be positive")
    start = max_response_len - buffer_len
    if response_len <= start:
        return 0.0
    if response_len >= max_response_len:
        return -1.0
    return (start - response_len) / buffer_len
