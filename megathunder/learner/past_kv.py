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
  the attention is differentiable torch (``scaled_dot_product_attention``, whose fused kernels keep
  memory linear in s_past + s), so d loss / d past flows either way.
- Outside ``segment`` the module is ordinary causal attention, so the same model serves the
  ledger's full-trajectory passes, logprobs and the batch reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from megathunder.learner.sdpa_attention import SDPAttention, with_core_attention

KV = tuple[torch.Tensor, torch.Tensor]


class PastKVAttention(SDPAttention):
    """Causal attention whose keys/values may be prefixed by a cache of past ones: ``SDPAttention``
    (torch's fused kernels, memory linear in s_past + s) over [past; current] keys and values,
    aligned bottom-right, so the current tokens see every past token and causally each other.

    Signature of Megatron's core attention: query [sq, b, np, hn], key/value [sk, b, ng, hn]
    (np heads and ng query groups of this tensor-parallel rank). Returns [sq, b, np * hn].
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout,
                         softmax_scale, cp_comm_type, pg_collection)
        self._cache: PastKV | None = None  # set by PastKV; not a submodule
        self._index = -1

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("PastKVAttention: packed sequences and attention bias are not supported")
        cache = self._cache
        if cache is not None and cache.active:
            if attention_mask is not None:
                raise ValueError("PastKVAttention: a segment forward is causal over its past (no attention mask)")
            cache.produced[self._index] = (key, value)
            past = cache.past[self._index] if cache.past is not None else None
            if past is not None:
                key = torch.cat([past[0], key], dim=0)
                value = torch.cat([past[1], value], dim=0)
        return self.attend(query, key, value, attention_mask)


def with_past_kv_attention(spec):
    """A copy of a GPT layer spec (local or Transformer Engine) whose self-attention's core
    attention is ``PastKVAttention``; the linear layers, norms and RoPE stay as in ``spec``."""
    return with_core_attention(spec, PastKVAttention)


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
