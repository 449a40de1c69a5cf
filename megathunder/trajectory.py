"""The unit of RL data: one sampled trajectory, with everything its loss needs except the reward.

Token layout: ``tokens`` holds the whole sequence (prompt, model turns, tool outputs). The model's
prediction at position ``t`` is for ``tokens[t + 1]``, so every per-token field below has one entry
per *target*, i.e. length ``len(tokens) - 1``. ``loss_mask`` is False on prompt and tool-output
targets.

A batch is declared by its ``BatchPlan``: the GRPO groups in order, each with its members'
trajectory ids in sample order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

BatchPlan = list[tuple[int, list[int]]]
"""[(group id, [trajectory ids of the group, in sample order]), ...] in group order."""


@dataclass
class Trajectory:
    traj_id: int
    group_id: int
    tokens: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L-1] bool, True on trained (model-generated) targets
    rollout_logprobs: torch.Tensor | None = None  # [L-1] logprobs reported by the rollout engine
    ref_logprobs: torch.Tensor | None = None  # [L-1] logprobs of the frozen reference model
    truncated: bool = False  # generation hit the length limit (DAPO overlong filtering)
    routed_experts: torch.Tensor | None = None
    """[L-1, num_layers, top_k] int16: the experts the rollout engine's MoE layers routed each
    input position (tokens[:-1]) to, for routing replay (``learner.moe.routing_replay``)."""

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
        if self.routed_experts is not None and (self.routed_experts.dim() != 3
                                                or self.routed_experts.shape[0] != num_targets):
            raise ValueError(f"trajectory {self.traj_id}: routed_experts has shape "
                             f"{tuple(self.routed_experts.shape)}, expected ({num_targets}, layers, top_k)")
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(f"trajectory {self.traj_id}: loss_mask must be bool")

    @property
    def num_targets(self) -> int:
        return self.tokens.numel() - 1


def batch_plan(trajs: Iterable[Trajectory]) -> BatchPlan:
    """The plan of a batch: groups in order of first appearance, members in the order given."""
    plan: dict[int, list[int]] = {}
    for traj in trajs:
        plan.setdefault(traj.group_id, []).append(traj.traj_id)
    return list(plan.items())


def loss_targets(trajs: Sequence[Trajectory]) -> tuple[list[int], list[torch.Tensor]]:
    """Each trajectory's number of loss-mask targets and their positions (``loss_mask.nonzero()``),
    computed for the whole list in a few operations, not a reduction and a ``nonzero`` per
    trajectory: a learner pass over 160 short trajectories spent more in those small operations
    (each a kernel launch on a GPU) than in some of its matmuls. The positions are views of one tensor."""
    if not trajs:
        return [], []
    lengths = torch.tensor([t.loss_mask.shape[0] for t in trajs])
    flat = torch.cat([t.loss_mask for t in trajs]).nonzero().squeeze(-1)  # into the concatenation
    owner = torch.repeat_interleave(torch.arange(len(trajs)), lengths)[flat]
    counts = torch.bincount(owner, minlength=len(trajs))
    starts = torch.cumsum(lengths, 0) - lengths
    return counts.tolist(), list((flat - starts[owner]).split(counts.tolist()))


def mask_spans(mask: torch.Tensor) -> list[list[int]]:
    """[start, end) runs of True: the loss mask in a few integers."""
    spans: list[list[int]] = []
    start = None
    for i, m in enumerate(mask.tolist() + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append([start, i])
            start = None
    return spans


def turn_spans(traj: Trajectory) -> list[tuple[int, int]]:
    """[start, end) token positions of the trajectory's model turns: the runs of its loss mask
    (target t is token t + 1; turns are separated by masked tool output or template glue)."""
    return [(a + 1, b + 1) for a, b in mask_spans(traj.loss_mask)]


def pack_micro_batches(lengths: Sequence[int], pack_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` (each item's padded length) grouped into micro-batches of at most
    ``pack_tokens`` tokens each, counting a micro-batch as rows x its longest row (the [b, T_max]
    tensor it is padded into).

    The items are taken longest first (ties in index order), so the rows of a micro-batch have
    nearly the same length: packed in arrival order, one long trajectory among short ones pads them
    all to its length, and the padded positions cost the whole model's compute (the local spec's
    unfused attention rows x T_max^2) -- on the tools workload's batches of 513-795-token
    trajectories 6-11% of a packed pass's positions were padding in arrival order, 2-3% longest
    first. Each group is the longest run from its first (longest) item that fits; an item longer
    than the cap is a micro-batch of its own. Concatenating the groups gives a permutation of
    0 .. n - 1; callers that report per item put the reports back in index order. ``pack_tokens``
    0: one item per micro-batch, in the caller's order (nothing is padded, so nothing to sort)."""
    if pack_tokens <= 0:
        return [[i] for i in range(len(lengths))]
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep index order
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= pack_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
