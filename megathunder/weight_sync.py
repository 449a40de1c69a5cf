"""Learner -> rollout weight sync by resharding, and the zero-staleness probe.

After each optimizer step the learner's TP/PP shards are gathered and converted to the inference
(Hugging Face) layout -- fused QKV split into q/k/v, [gate; up] split, vocab shards joined --
by ``megathunder.learner.hf``, and pushed into every vLLM worker with the engine's
``update_weights`` (which drains, reloads from the in-memory tensors, resets the prefix cache and
stamps the policy version). How the tensors travel is ``rollout.engine.weight_transfer``: inside
the ``collective_rpc`` payload, or bucketed broadcast over a gloo / NCCL group the workers joined at
engine start (``megathunder.rollout.engines.transfer``); either way vLLM's in-place
``reload_weights`` loads them.

The probe then asks the engine for the logprobs of fixed tokens and compares them with the
learner's own: equal to float tolerance means the engine samples from the weights being trained.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megathunder.learner import hf
from megathunder.rollout.types import RolloutEngine, SamplingParams
from megathunder.trajectory import Trajectory


class StaleWeightsError(RuntimeError):
    """The rollout engine's logprobs do not match the learner's after a sync."""


def inference_weights(learner) -> list[tuple[str, torch.Tensor]] | None:
    """The learner's full weights in Hugging Face names on global rank 0 (None elsewhere).

    A collective over the learner's ranks: every rank must call it."""
    full = hf.gather_full_state(learner.model, learner.model_cfg, learner.groups, learner.offset)
    if full is None:
        return None
    return list(hf.megatron_to_hf(full, learner.model_cfg).items())


async def push_weights(learner, engine: RolloutEngine | None, policy_version: int) -> None:
    """Gather (every rank) and push (rank 0, which owns the engine handle)."""
    weights = inference_weights(learner)
    if weights is not None and engine is not None:
        await engine.update_weights(weights, policy_version)


def max_logprob_gap(engine_logp: Sequence[float], learner_logp: torch.Tensor) -> float:
    return float((torch.tensor(list(engine_logp), dtype=torch.float64) - learner_logp.double()).abs().max())


async def probe_staleness(learner, engine: RolloutEngine, prompt: Sequence[int], num_tokens: int,
                          tolerance: float, seed: int = 0) -> float:
    """Sample ``num_tokens`` from the engine, score the same tokens with the learner, compare.

    Run on every learner rank (the learner's scoring is a collective); ``engine`` may be None off
    rank 0, where the sampled tokens arrive by broadcast. Raises ``StaleWeightsError`` when the
    largest per-token gap exceeds ``tolerance``; returns it otherwise.
    """
    import torch.distributed as dist

    box: list = [None]
    if engine is not None:
        completion = await engine.generate(prompt, SamplingParams(max_new_tokens=num_tokens, temperature=1.0,
                                                                  seed=seed, ignore_eos=True))
        box[0] = (completion.token_ids, completion.logprobs)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    token_ids, engine_logp = box[0]
    tokens = torch.tensor(list(prompt) + list(token_ids))
    mask = torch.zeros(tokens.numel() - 1, dtype=torch.bool)
    mask[len(prompt) - 1:] = True
    traj = Trajectory(traj_id=-1, group_id=-1, tokens=tokens, loss_mask=mask)
    learner_logp = learner.token_logprobs([traj])
    if learner_logp is None:  # not the last pipeline stage
        return 0.0
    gap = max_logprob_gap(engine_logp, learner_logp[0][len(prompt) - 1:])
    if gap > tolerance:
        raise StaleWeightsError(
            f"rollout engine logprobs differ from the learner's by {gap:.3e} (> {tolerance:.1e}) "
            f"at policy version {engine.policy_version if engine is not None else '?'}: the engine is "
            "not sampling from the weights being trained"
        )
    return gap
