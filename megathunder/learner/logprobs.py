"""Token log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the vocabulary. With m the global max and
s_v = z_v - m:

    S       = sum_ranks sum_local exp(s_v)          A = sum_ranks sum_local exp(s_v) s_v
    logp(y) = s_y - log S                     (s_y lives on exactly one rank; the others add 0)
    H       = log S - A / S                   (-sum p log p with p = exp(s) / S)

Only the three local partial sums (exp-sum, weighted sum, target logit) cross ranks, through
Megatron's reduce-from-model-parallel-region (all-reduce forward, identity backward). Everything
after the reduction is computed identically on every rank, which is what makes the identity
backward correct: each rank's partial sum gets exactly the gradient of the replicated loss.
(Using a reduced value inside a rank-local sum -- e.g. p_v = exp(s_v - log S) summed locally and
then reduced -- would silently drop the other ranks' terms from d/dS.) With one tensor-parallel
rank no collective runs.

``temperature``: the distribution vLLM samples from at ``rollout.temperature`` is softmax(z / T),
and its logprobs are what the rollout engine reports (``logprobs_mode: processed_logprobs``); the
learner's logprobs (and entropy) are of the same distribution, so z is divided by T first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _sum_across(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


def vocab_parallel_logprobs(
    logits_local: torch.Tensor,
    targets: torch.Tensor,
    group: dist.ProcessGroup | None,
    need_entropy: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits_local [..., V/tp] (this rank's vocabulary slice), targets [...] global token ids;
    log-probabilities of softmax(logits / temperature)."""
    if logits_local.dtype in (torch.float16, torch.bfloat16):
        logits_local = logits_local.float()
    if temperature != 1.0:
        logits_local = logits_local / temperature
    vocab_local = logits_local.shape[-1]
    tp_rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    start = tp_rank * vocab_local

    max_logit = logits_local.detach().amax(dim=-1)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
    shifted = logits_local - max_logit.unsqueeze(-1)
    exp_shifted = shifted.exp()
    sum_exp = _sum_across(exp_shifted.sum(dim=-1), group)
    log_z = sum_exp.log()

    in_slice = (targets >= start) & (targets < start + vocab_local)
    local_index = (targets - start).clamp(0, vocab_local - 1)
    target_shifted = shifted.gather(-1, local_index.unsqueeze(-1)).squeeze(-1)
    target_shifted = _sum_across(torch.where(in_slice, target_shifted, 0.0), group)
    logp = target_shifted - log_z

    entropy = None
    if need_entropy:
        weighted = _sum_across((exp_shifted * shifted).sum(dim=-1), group)
        entropy = log_z - weighted / sum_exp
    return logp, entropy
