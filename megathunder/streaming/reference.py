"""The batch-synchronous reference: the gradient the classic way, every reward known up front.

    1. advantages per group (``objectives.group_stats``), DAPO keep/drop per group;
    2. Z over the kept trajectories (``objectives.normaliser``);
    3. one loss over the batch -- split into micro-batches of ``micro_batch_size`` trajectories,
       each micro-batch's unnormalised loss ``sum_i loss_i(A_i, keep)`` backpropagated and
       accumulated in sample order -- then the accumulated gradient divided by Z once.

With ``micro_batch_size=None`` the whole batch is one padded forward and one backward;
``pack_tokens`` groups the micro-batches as the Megatron learner's ``learner.pack_tokens`` does
(``trajectory.pack_micro_batches``). Every
streamed update in this project is tested against this function; ``reference_ppo_update`` is the
same for several optimizer steps per batch (PPO epochs and mini-batches).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from megathunder.config import RLObjective
from megathunder.objectives import (
    LossSpec,
    advantage,
    batch_divisor,
    group_stats,
    keeps_group,
    normaliser,
    num_loss_tokens,
    token_logprobs_and_entropy,
    trajectory_loss,
)
from megathunder.objectives.ppo import update_plan
from megathunder.trajectory import Trajectory, pack_micro_batches


def batch_advantages(
    batch: Sequence[Trajectory], rewards: Sequence[float], cfg: RLObjective
) -> tuple[list[float | None], float]:
    """Per-trajectory advantage (None for a dropped group) and the normaliser Z."""
    by_group: dict[int, list[int]] = {}
    for i, traj in enumerate(batch):
        by_group.setdefault(traj.group_id, []).append(i)
    stats, keep = {}, {}
    for gid, idx in by_group.items():
        group_rewards = [float(rewards[i]) for i in idx]
        stats[gid] = group_stats(group_rewards, cfg)
        keep[gid] = keeps_group(group_rewards, cfg)
    kept = [i for i, t in enumerate(batch) if keep[t.group_id]]
    divisor = batch_divisor([rewards[i] - stats[batch[i].group_id].mean for i in kept], cfg)
    advantages: list[float | None] = [
        advantage(rewards[i], stats[t.group_id], divisor) if keep[t.group_id] else None
        for i, t in enumerate(batch)
    ]
    z = normaliser([num_loss_tokens(batch[i], cfg) for i in kept], cfg)
    return advantages, z


def batch_loss(
    model: nn.Module,
    trajs: Sequence[Trajectory],
    advantages: Sequence[float],
    cfg: RLObjective,
    old_logps: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Unnormalised ``sum_i loss_i(A_i)`` of some kept trajectories, one (padded) forward."""
    lengths = [t.tokens.numel() for t in trajs]
    tokens = torch.zeros(len(trajs), max(lengths), dtype=torch.long)
    for row, t in enumerate(trajs):
        tokens[row, : lengths[row]] = t.tokens
    logits = model(tokens)
    total = torch.zeros((), dtype=logits.dtype)
    for row, t in enumerate(trajs):
        logp, entropy = token_logprobs_and_entropy(
            logits[row, : lengths[row] - 1], t.tokens[1:], need_entropy=cfg.entropy_coef > 0
        )
        spec = LossSpec(advantage=advantages[row], reward_free=cfg.has_reward_free_terms)
        old = None if old_logps is None else old_logps[row]
        total = total + trajectory_loss(logp, entropy, t, spec, cfg, old_logp_T=old)
    return total


def reference_gradient(
    model: nn.Module,
    batch: Sequence[Trajectory],
    rewards: Sequence[float],
    cfg: RLObjective,
    micro_batch_size: int | None = None,
    pack_tokens: int | None = None,
) -> torch.Tensor:
    """The flat gradient (parameters in ``model.parameters()`` order) of the batch loss, its
    micro-batches of ``micro_batch_size`` trajectories or, with ``pack_tokens``, packed by tokens."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]  # e.g. a TorchBackend's views; restored below
    for p in params:
        p.grad = None
    advantages, z = batch_advantages(batch, rewards, cfg)
    kept = [(i, a) for i, a in enumerate(advantages) if a is not None]
    if pack_tokens is not None:
        chunks = [[kept[j] for j in g] for g in pack_micro_batches([batch[i].num_targets for i, _ in kept], pack_tokens)]
    else:
        step = micro_batch_size or max(len(kept), 1)
        chunks = [kept[start : start + step] for start in range(0, len(kept), step)]
    for chunk in chunks:
        loss = batch_loss(model, [batch[i] for i, _ in chunk], [a for _, a in chunk], cfg)
        loss.backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    for p, g in zip(params, saved, strict=True):
        p.grad = g
    return flat.div_(z)


def reference_ppo_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Sequence[Trajectory],
    rewards: Sequence[float],
    cfg: RLObjective,
) -> int:
    """PPO epochs and mini-batches on a plain torch model (``megathunder.objectives.ppo``): the
    reference the Megatron learner's ``ppo_gradient`` is tested against. Old logprobs from one
    forward at the batch's start (``ppo_old_logprobs: learner``) or the trajectories' rollout
    logprobs; every mini-batch one padded forward, its loss divided by its own Z, one step.
    Returns the number of optimizer steps."""
    all_advantages, _ = batch_advantages(batch, rewards, cfg)
    advantages = {i: a for i, a in enumerate(all_advantages) if a is not None}
    kept = list(advantages)
    if cfg.ppo_old_logprobs == "rollout":
        old = {i: batch[i].rollout_logprobs for i in kept}
    else:
        with torch.no_grad():
            old = {i: _logprobs(model, batch[i]) for i in kept}
    plan = update_plan(kept, cfg)
    for chunk in plan:
        optimizer.zero_grad(set_to_none=True)
        if chunk:
            loss = batch_loss(model, [batch[i] for i in chunk], [advantages[i] for i in chunk], cfg,
                              old_logps=[old[i] for i in chunk])
            (loss / normaliser([num_loss_tokens(batch[i], cfg) for i in chunk], cfg)).backward()
        optimizer.step()
    return len(plan)


def _logprobs(model: nn.Module, traj: Trajectory) -> torch.Tensor:
    logits = model(traj.tokens[None])[0, :-1]
    return token_logprobs_and_entropy(logits, traj.tokens[1:], need_entropy=False)[0]
