"""Advantages from rewards: GRPO, Dr.GRPO, RLOO and batch-std scaling.

Every variant is affine in the trajectory's own reward once its group is known:

    A_i = coef_g * (r_i - mu_g) / d

with ``mu_g`` the group mean, ``coef_g`` a group scalar and ``d`` a batch scalar (1 except for
batch_std). The ledger streams exactly because of this form (see ``megathunder.streaming.ledger``),
and it uses the functions below, so the scalars it applies are bitwise the ones the batch
reference uses.

Group statistics are computed in float64 over rewards in sample order, shifted by the group's
first reward: ``mu = b + sum(r - b) / G``. The shift keeps large-offset rewards well conditioned
and makes an all-equal group give ``mu == r`` and ``std == 0`` exactly, hence exact zero
advantages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megathunder.config import RLObjective


@dataclass(frozen=True)
class GroupStats:
    mean: float
    std: float
    coef: float  # A_i = coef * (r_i - mean) / batch_divisor


def group_stats(rewards: Sequence[float], cfg: RLObjective) -> GroupStats:
    """Mean, std and advantage coefficient of one group, rewards in sample order."""
    size = len(rewards)
    if size == 0:
        raise ValueError("group_stats: empty group")
    if size == 1 and cfg.singleton_group == "raw_score":  # verl: mean 0, std 1
        return GroupStats(mean=0.0, std=1.0, coef=1.0 / (1.0 + cfg.std_eps) if cfg.advantage == "grpo" else 1.0)
    mean = group_mean(rewards)
    dof = size - 1 if cfg.std_unbiased else size
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / dof) if dof > 0 else 0.0
    coef = 1.0 / (std + cfg.std_eps) if cfg.advantage == "grpo" else size_coef(size, cfg)
    return GroupStats(mean=mean, std=std, coef=coef)


def group_mean(rewards: Sequence[float]) -> float:
    """``mu_g``: float64, sample order, shifted by the first reward (an all-equal group's mean is
    its reward exactly)."""
    shift = rewards[0]
    return shift + math.fsum(r - shift for r in rewards) / len(rewards)


def coef_known_before_close(cfg: RLObjective) -> bool:
    """True when ``coef_g`` depends only on the group size (not on its rewards)."""
    return cfg.advantage != "grpo"


def size_coef(size: int, cfg: RLObjective) -> float:
    """``coef_g`` of the variants whose coefficient depends only on the group size."""
    if cfg.advantage == "rloo":
        # r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean); a lone sample has no baseline
        # (singleton_group: 0, or verl's raw score with mean 0).
        if size > 1:
            return size / (size - 1)
        return 1.0 if cfg.singleton_group == "raw_score" else 0.0
    if cfg.advantage in ("dr_grpo", "batch_std"):
        return 1.0
    raise ValueError(f"advantage {cfg.advantage!r} has a reward-dependent coefficient")


def keeps_group(rewards: Sequence[float], cfg: RLObjective) -> bool:
    """DAPO dynamic sampling: a group whose rewards are all equal carries no signal (a group of one
    is kept under ``dapo_singletons: keep``, verl's recipe)."""
    if not cfg.dapo_dynamic_sampling:
        return True
    if len(rewards) == 1:
        return cfg.dapo_singletons == "keep"
    return any(r != rewards[0] for r in rewards)


def batch_divisor(centered: Sequence[float], cfg: RLObjective) -> float:
    """``d``: 1, or for batch_std the std of ``r_i - mu_g`` over kept samples (sample order) + eps."""
    if cfg.advantage != "batch_std":
        return 1.0
    n = len(centered)
    dof = n - 1 if cfg.std_unbiased else n
    if dof <= 0:
        return 1.0 + cfg.std_eps
    mean = math.fsum(centered) / n
    return math.sqrt(math.fsum((c - mean) ** 2 for c in centered) / dof) + cfg.std_eps


def advantage(reward: float, stats: GroupStats, divisor: float = 1.0) -> float:
    return stats.coef * (reward - stats.mean) / divisor
