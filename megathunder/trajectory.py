"""The unit of RL data: one sampled trajectory, with everything its loss needs except the reward.

Token layout: ``tokens`` holds the whole sequence (prompt, model turns, tool outputs). The model's
prediction at position ``t`` is for ``tokens[t + 1]``, so every per-token field below has one entry
per *target*, i.e. length ``len(tokens) - 1``. ``loss_mask`` is False on prompt and tool-output
targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Trajectory:
    traj_id: int
    group_id: int
    tokens: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L-1] bool, True on trained (model-generated) targets
    rollout_logprobs: torch.Tensor | None = None  # [L-1] logprobs reported by the rollout engine
    ref_logprobs: torch.Tensor | None = None  # [L-1] logprobs of the frozen reference model
    truncated: bool = False  # generation hit the length limit (DAPO overlong filtering)

    def __post_init__(self) -> None:
        num_targets = self.tokens.numel() - 1
        if self.tokens.dim() != 1 or num_targets < 1:
            raise ValueError(f"trajectory {self.traj_id}: tokens must be 1-D with length >= 2")
        for name in ("loss_mask", "rollout_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and value.shape != (num_targets,):
                raise ValueError(
                    f"trajectory {self.traj_id}: {name} has shape {tuple(value.shape)}, "
                    f"expected ({num_targets},) (one entry per target token)"
                )
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(f"trajectory {self.traj_id}: loss_mask must be bool")

    @property
    def num_targets(self) -> int:
        return self.tokens.numel() - 1
