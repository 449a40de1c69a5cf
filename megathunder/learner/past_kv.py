"""Attention over past keys/values with autograd, as a Megatron layer-spec module of our own.

Per-turn OPD (``megathunder.streaming.opd_turns``) forwards a trajectory one segment at a time on
top of the earlier segments' keys and values. Stock Megatron attention only attends within the
current sequence (its inference KV cache is forward-only), so ``PastKVAttention`` replaces the
``core_attention`` submodule of ``SelfAttention`` in the local or the Transformer Engine layer spec
(``layer_spec(..., core_attention="past_kv")``). Everything else of the layer -- fused QKV
projection, q/k norms, RoPE, output projection, the tensor-parallel collectives -- stays Megatron's.

    cache = PastKV(gpt_model)                       # once per model
    with cache.segment(past) as produced:           # past: per layer (K, V) [s_past, b, g, d], or None
        logits = gpt_model(tokens, positions, attention_mask=None)
    produced                                        # per layer this segment's (K, V), in the graph

- K/V are this rank's query groups (heads are split over tensor-parallel ranks, so the cache is
  too); keys are stored after RoPE, so the past never needs re-rotating.
- Inside ``segment`` the model's rotary embedding is offset by the past length (a forward
  pre-hook on ``GPTModel.rotary_pos_emb``): the new tokens get positions s_past, s_past + 1, ...
- ``past`` may be autograd leaves (``requires_grad``) or attached to an earlier segment's graph:
  the attention is plain differentiable torch, so d loss / d past flows either way.
- Outside ``segment`` the module is ordinary causal attention, so the same model serves the
  ledger's full-trajectory passes, logprobs and the batch reference.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Sequence

import torch
from megatron.core.transformer.module import MegatronModule

KV = tuple[torch.Tensor, torch.Tensor]


class PastKVAttention(MegatronModule):
    """Causal dot-product attention whose keys/values may be prefixed by a cache of past ones.

    Signature of Megatron's core attention: query [sq, b, np, hn], key/value [sk, b, ng, hn]
    (np heads and ng query groups of this tensor-parallel rank). Returns [sq, b, np * hn].
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("PastKVAttention: attention_dropout must be 0 (exact per-turn gradients)")
        if config.context_parallel_size != 1:
            raise ValueError("PastKVAttention: context parallelism is not supported")
        if config.apply_query_key_layer_scaling:
            raise ValueError("PastKVAttention: apply_query_key_layer_scaling is not supported")
        tp = pg_collection.tp.size() if pg_collection is not None else 1
        self.layer_number = layer_number
        self.num_heads = config.num_attention_heads // tp
        self.num_groups = max(config.num_query_groups // tp, 1)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.softmax_in_fp32 = config.attention_softmax_in_fp32 or config.fp16 or config.bf16
        self._cache: PastKV | None = None  # set by PastKV; not a submodule
        self._index = -1

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("PastKVAttention: packed sequences and attention bias are not supported")
        cache = self._cache
        if cache is not None and cache.active:
            cache.produced[self._index] = (key, value)
            past = cache.past[self._index] if cache.past is not None else None
            if past is not None:
                key = torch.cat([past[0], key], dim=0)
                value = torch.cat([past[1], value], dim=0)
        sq, b = query.shape[0], query.shape[1]
        num_past = key.shape[0] - sq
        repeat = self.num_heads // self.num_groups
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.repeat_interleave(repeat, dim=2).permute(1, 2, 3, 0)  # [b, np, hn, sk]
        v = value.repeat_interleave(repeat, dim=2).permute(1, 2, 0, 3)  # [b, np, sk, hn]
        scores = torch.matmul(q, k) * self.softmax_scale
        visible = torch.ones(sq, sq + num_past, dtype=torch.bool, device=query.device).tril(num_past)
        scores = scores.masked_fill(~visible, float("-inf"))
        if self.softmax_in_fp32:
            probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        else:
            probs = torch.softmax(scores, dim=-1)
        context = torch.matmul(probs, v)  # [b, np, sq, hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.num_heads * self.head_dim)


def with_past_kv_attention(spec):
    """A copy of a GPT layer spec (local or Transformer Engine) whose self-attention's core
    attention is ``PastKVAttention``; the linear layers, norms and RoPE stay as in ``spec``."""
    spec = copy.deepcopy(spec)
    attention = spec.submodules.self_attention
    if getattr(attention.submodules, "core_attention", None) is None:
        raise ValueError("with_past_kv_attention: the layer spec has no self_attention.core_attention")
    attention.submodules.core_attention = PastKVAttention
    return spec


class PastKV:
    """The past K/V a GPTModel's ``PastKVAttention`` layers read during one segment forward, and
    the K/V they produce. One per model; models are not re-entrant (one segment at a time)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, PastKVAttention)]
        if not self.layers:
            raise ValueError("PastKV: the model has no PastKVAttention (learner.precision.core_attention)")
        for i, layer in enumerate(self.layers):
            layer._cache, layer._index = self, i
        self.active = False
        self.past: Sequence[KV | None] | None = None
        self.num_past = 0
        self.produced: list[KV | None] = []
        rotary = getattr(model, "rotary_pos_emb", None)
        if rotary is not None:
            rotary.register_forward_pre_hook(self._offset_rotary, with_kwargs=True)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _offset_rotary(self, module, args, kwargs):
        if self.active and self.num_past:
            kwargs = dict(kwargs, offset=kwargs.get("offset", 0) + self.num_past)
        return args, kwargs

    @contextlib.contextmanager
    def segment(self, past: Sequence[KV] | None) -> Iterator[list[KV | None]]:
        """Forwards inside attend to ``past`` (per layer, [s_past, b, g, d]) first; yields the list
        that receives each layer's new (K, V)."""
        if self.active:
            raise RuntimeError("PastKV.segment: already inside a segment forward")
        if past is not None and len(past) != self.num_layers:
            raise ValueError(f"PastKV.segment: {len(past)} past layers for {self.num_layers} attention layers")
        self.past = past
        self.num_past = past[0][0].shape[0] if past else 0
        self.produced = [None] * self.num_layers
        self.active = True
        try:
            yield self.produced
        finally:
            self.active = False
            self.past = None
            self.num_past = 0
