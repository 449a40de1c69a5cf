"""DAPO's length handling: overlong filtering (a loss mask).

Dynamic sampling, DAPO's third trick, is a group decision: ``advantages.keeps_group``.
"""

from __future__ import annotations

import torch

from megathunder.trajectory import Trajectory


def filtered_as_overlong(traj: Trajectory, overlong_filter: bool) -> bool:
    """Whether none of the trajectory's targets is trained (DAPO's overlong filter)."""
    return overlong_filter and traj.truncated


def effective_loss_mask(traj: Trajectory, overlong_filter: bool) -> torch.Tensor:
    """The trained targets: the trajectory's loss mask, all False if it is filtered as overlong."""
    if filtered_as_overlong(traj, overlong_filter):
        return torch.zeros_like(traj.loss_mask)
    return traj.loss_mask
