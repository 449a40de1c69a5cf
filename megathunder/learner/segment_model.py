"""A Megatron GPTModel as the per-turn streamer's ``SegmentModel``.

The per-turn OPD strategies (recompute, kv_adjoint, forward_early) live once, in
``megathunder.streaming.opd_turns.TurnStreamer``, written against two small interfaces; this
module plugs Megatron into the first. ``MegatronSegmentModel`` forwards one segment of a
trajectory on top of past keys/values through ``PastKVAttention``
(``learner.precision.core_attention=past_kv``), gives token logprobs from vocab-parallel logits and
backward passes into DDP's gradient buffers inside ``no_sync``. Under tensor parallelism each rank
holds its heads' K/V; every rank of a tensor-parallel group must receive the same events in the
same order (the forward and backward communicate). The divergence is the reverse KL
(sampled-token logprobs) or GKD's generalized JSD over the whole, vocabulary-parallel
distribution (``log_softmax`` / ``vocab_sum`` below). The teacher (``megathunder.learner.teacher``)
is a frozen model of the same kind.

Pipeline parallelism is not supported by the KV strategies (a segment forward is a plain model
call, not a pipeline schedule); ``recompute`` needs no past K/V but uses the same plain call here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from megathunder.config import ConfigError, LearnerConfig
from megathunder.learner.logprobs import vocab_parallel_logprobs
from megathunder.learner.parallel import ProcessGroups
from megathunder.learner.past_kv import KV, PastKV, PastKVAttention
from megathunder.streaming.buffers import GradBuffer
from megathunder.streaming.opd_turns import CachedTeacher


def past_kv_of(model: torch.nn.Module) -> PastKV:
    """The one ``PastKV`` of a GPTModel (created on first use)."""
    cache = getattr(model, "_megathunder_past_kv", None)
    if cache is None:
        cache = PastKV(model)
        model._megathunder_past_kv = cache
    return cache


class MegatronSegmentModel:
    """``SegmentModel`` over a Megatron GPTModel; K/V are [s, b, groups/tp, head_dim]."""

    kv_seq_dim = 0

    def __init__(self, model: torch.nn.Module, pgs: ProcessGroups, temperature: float = 1.0) -> None:
        if pgs.dims.pp > 1:
            raise ConfigError("learner.parallel.pipeline_parallel: per-turn segment forwards do not run with "
                              "pipeline parallelism")
        self.model = model  # DDP wrapper (student) or bare GPTModel (teacher)
        gpt = getattr(model, "module", model)
        has_past_kv = any(isinstance(m, PastKVAttention) for m in gpt.modules())
        self.cache = past_kv_of(gpt) if has_past_kv else None  # recompute needs none
        self.pgs = pgs
        self.temperature = temperature  # the student's sampling temperature; a teacher scores at 1
        buffers = getattr(model, "buffers", None)
        self.live = GradBuffer([b.grad_data for b in buffers]) if isinstance(buffers, list) else None

    def forward_segment(self, tokens: torch.Tensor, past: Sequence[KV] | None) -> tuple[torch.Tensor, list[KV]]:
        device = self.pgs.device
        tokens = tokens.to(device)
        num_past = past[0][0].shape[0] if past else 0
        positions = torch.arange(num_past, num_past + tokens.numel(), device=device)[None]
        if self.cache is None:
            if past:
                raise ConfigError("learner.precision.core_attention: past_kv is needed to forward on past K/V")
            return self.model(tokens[None], positions, attention_mask=None)[0], []
        with self.cache.segment(past) as produced:
            logits = self.model(tokens[None], positions, attention_mask=None)
        kv = [layer for layer in produced if layer is not None]
        assert len(kv) == len(produced), "a PastKVAttention layer produced no K/V"
        return logits[0], kv

    def logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logprobs(logits, targets.to(logits.device), self.pgs.tp,
                                       temperature=self.temperature)[0]

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probability rows of this rank's vocabulary slice. The log-partition is a sum over
        every rank whose result feeds rank-local terms, so its reduction is an all-reduce in the
        backward too (an identity backward would drop the other ranks' share of d/dlogZ)."""
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        if self.temperature != 1.0:
            logits = logits / self.temperature
        group = self.pgs.tp
        shift = logits.detach().amax(dim=-1, keepdim=True)
        if self.pgs.dims.tp > 1:
            torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX, group=group)
        shifted = logits - shift
        sum_exp = shifted.exp().sum(dim=-1, keepdim=True)
        if self.pgs.dims.tp > 1:
            from torch.distributed.nn.functional import all_reduce

            sum_exp = all_reduce(sum_exp, group=group)
        return shifted - sum_exp.log()

    def vocab_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the sharded vocabulary: the loss after it is replicated, so each rank's local
        terms take the identity backward (Megatron's reduce-from-model-parallel region)."""
        local = x.sum(dim=-1)
        if self.pgs.dims.tp == 1:
            return local
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(local, group=self.pgs.tp)

    def backward(self, outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None,
                 retain_graph: bool = False) -> None:
        with self.model.no_sync():
            torch.autograd.backward(list(outputs), None if grads is None else list(grads),
                                    retain_graph=retain_graph)

    def divide_grads(self, z: float) -> None:
        assert self.live is not None, "a model without gradient buffers (the teacher) has no gradient"
        self.live.div_(z)
