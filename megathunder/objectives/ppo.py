"""PPO epochs and mini-batches: several optimizer steps per batch (sync, async, fully_async).

With ``E = objective.num_ppo_epochs`` and ``M = objective.num_minibatches_per_batch``, one batch
is trained as verl, OpenRLHF and TRL do:

    1. every reward known: advantages A_i over the whole batch (groups, DAPO drop, batch_std);
    2. the old logprobs l^old_i of every kept trajectory fixed once (``ppo_old_logprobs``):
       learner  the learner's own logprobs at the batch's start (one forward; verl's old_log_prob),
       rollout  the engine's logprobs of the sampled tokens (the behaviour policy itself);
    3. for each epoch e, for each mini-batch B_k (``minibatches``: the kept trajectories in batch
       order, as M contiguous chunks as equal as possible -- whole groups when M divides the
       number of groups):
           g = (1/Z_k) sum_{i in B_k} grad loss_i(theta; A_i, l^old_i),   Z_k the mini-batch's own
           normaliser (``objective.loss_agg`` over B_k), then one optimizer step.

``loss_i`` is ``megathunder.objectives.trajectory_loss``, the same function as everywhere: with
``old_logp`` given, the ratio exp(l - l^old) differs from 1 after the first step, and PPO-clip
(with ``clip_ratio_c``: dual clip), GSPO and CISPO clip against l^old. TIS weights use l^old too
(learner: exp(l^old - l^rollout), fixed for the whole batch).

The learning-rate schedule advances once per batch (not per mini-batch), as verl's does.

Why thunder refuses it: the second step's gradient is taken at the parameters after the first,
which depend on the first mini-batch's whole gradient -- no trajectory's later gradients are fixed
when its reward arrives. E = M = 1 with ``ppo_old_logprobs: learner`` is the one-step case every
schedule shares (ratio 1, no extra forward).
"""

from __future__ import annotations

from collections.abc import Sequence

from megathunder.config import RLObjective


def minibatches(kept: Sequence[int], num: int) -> list[list[int]]:
    """``kept`` (batch order) as ``num`` contiguous chunks, the first ``len % num`` one longer;
    empty chunks (fewer trajectories than mini-batches) left out."""
    size, extra = divmod(len(kept), num)
    out, start = [], 0
    for k in range(num):
        end = start + size + (1 if k < extra else 0)
        if end > start:
            out.append(list(kept[start:end]))
        start = end
    return out


def update_plan(kept: Sequence[int], cfg: RLObjective) -> list[list[int]]:
    """The mini-batches of every optimizer step of one batch, in order (epoch-major). At least one
    step, possibly empty (a batch whose groups were all dropped still steps once, as before)."""
    chunks = minibatches(kept, cfg.num_minibatches_per_batch) or [[]]
    return [chunk for _ in range(cfg.num_ppo_epochs) for chunk in chunks]
