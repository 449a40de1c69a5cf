"""Core attention on torch's ``scaled_dot_product_attention``, as a Megatron layer-spec module.

Megatron's local layer spec computes attention unfused (``DotProductAttention``): it keeps the
s x s softmax probabilities of every head for the backward, so one trajectory's attention
activations grow with the square of its length -- for a 32k-token trajectory of Qwen2.5-32B at
TP 8, 5 heads x 32k^2 x 2 bytes = 10 GiB per layer in bf16, 320 GiB for a 32-layer pipeline stage
(``megathunder plan`` counts it). Transformer Engine's fused attention avoids that, but needs TE
(GPUs). ``SDPAttention`` replaces the
``core_attention`` submodule of ``SelfAttention`` in either spec with torch's fused kernels
(flash / memory-efficient on GPU, the flash kernel on CPU), which keep only the output and the
per-row log-sum-exp: memory linear in the length, and the same function.

Why it is the same function: for each query row, softmax(q K^T * scale + causal mask) V over the
visible keys, exactly what ``DotProductAttention`` computes (no dropout, no scaling tricks); only
the order of the floating-point sums differs (online softmax), so gradients agree within float
tolerance (``tests/distributed/test_learner.py``'s memory options). ``core_attention: auto`` (the
default) builds the local spec with it.

- Layout: Megatron's -- query [sq, b, np, hn], key/value [sk, b, ng, hn] (this tensor-parallel
  rank's heads and query groups), output [sq, b, np * hn].
- Causal, aligned bottom-right when sk > sq (queries are the last sq positions: the per-turn OPD
  forward over past keys/values, ``megathunder.learner.past_kv``); top-left = bottom-right when
  sq = sk.
- Grouped-query attention through ``enable_gqa`` where the kernel supports it (CPU; bf16/fp16 on
  GPU); fp32 on GPU repeats K/V per head first (linear memory), since the memory-efficient kernel
  has no GQA and would otherwise fall back to the O(s^2) math kernel.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch.nn.attention.bias import causal_lower_right


class SDPAttention(MegatronModule):
    """Causal attention through ``torch.nn.functional.scaled_dot_product_attention``, with the
    signature of Megatron's core attention."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        super().__init__(config=config)
        name = type(self).__name__
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"{name}: attention_dropout must be 0")
        if config.context_parallel_size != 1:
            raise ValueError(f"{name}: context parallelism is not supported (it needs Transformer Engine's attention)")
        if config.apply_query_key_layer_scaling:
            raise ValueError(f"{name}: apply_query_key_layer_scaling is not supported")
        if attn_mask_type not in (AttnMaskType.causal, None):
            raise ValueError(f"{name}: only causal self-attention is supported (got {attn_mask_type})")
        tp = pg_collection.tp.size() if pg_collection is not None else 1
        self.layer_number = layer_number
        self.num_heads = config.num_attention_heads // tp
        self.num_groups = max(config.num_query_groups // tp, 1)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError(f"{type(self).__name__}: packed sequences and attention bias are not supported")
        return self.attend(query, key, value, attention_mask)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of the sq queries, the last sq positions of the sk keys/values; or, given
        ``mask`` ([b, 1, sq, sk], True where a query must not see a key: Megatron's convention), that
        mask's (``megathunder.learner.shared_prefix``'s rows)."""
        sq, b, sk = query.shape[0], query.shape[1], key.shape[0]
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)  # [b, ng, sk, hn]
        v = value.permute(1, 2, 0, 3)
        gqa = self.num_groups != self.num_heads
        if gqa and query.is_cuda and query.dtype == torch.float32:
            repeat = self.num_heads // self.num_groups
            k, v, gqa = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1), False
        if mask is not None:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, scale=self.softmax_scale,
                                                     enable_gqa=gqa)
        elif sq == sk:
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                     enable_gqa=gqa)
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(sq, sk),
                                                     scale=self.softmax_scale, enable_gqa=gqa)
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.num_heads * self.head_dim)


def with_core_attention(spec, core_attention: type):
    """A copy of a GPT layer spec (local or Transformer Engine) whose self-attention's core
    attention is ``core_attention``; the linear layers, norms and RoPE stay as in ``spec``."""
    spec = copy.deepcopy(spec)
    attention = spec.submodules.self_attention
    if getattr(attention.submodules, "core_attention", None) is None:
        raise ValueError("with_core_attention: the layer spec has no self_attention.core_attention")
    attention.submodules.core_attention = core_attention
    return spec
