"""A small pre-norm decoder (RMSNorm, RoPE-free learned positions, causal attention, SwiGLU) in plain
PyTorch.

It exists for the backend-agnostic streaming core: float64 exactness tests and the CPU exactness
run need a real transformer whose every parameter gets gradient through attention, with no
distributed machinery. The learner that trains users' models is Megatron-core's GPTModel.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from megathunder.config import DecoderConfig


class _Block(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.attn_norm = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d)
        self.gate_up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(
        self, x_BLD: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Returns the block's output and this segment's (K, V) [B, H, L, hd]."""
        B, L, D = x_BLD.shape
        q, k, v = self.qkv(self.attn_norm(x_BLD)).split(D, dim=-1)
        q, k, v = (t.view(B, L, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        if past is None:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            num_past = past[0].shape[2]
            keys, values = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
            mask = torch.ones(L, num_past + L, dtype=torch.bool, device=x_BLD.device).tril(num_past)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x_BLD = x_BLD + self.proj(attn.transpose(1, 2).reshape(B, L, D))
        gate, up = self.gate_up(self.mlp_norm(x_BLD)).chunk(2, dim=-1)
        return x_BLD + self.down(F.silu(gate) * up), (k, v)


class TorchDecoder(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens_BL: torch.Tensor) -> torch.Tensor:
        """Logits [B, L, V] for every position (position t predicts token t + 1)."""
        return self.forward_with_cache(tokens_BL)[0]

    def forward_with_cache(
        self, tokens_BL: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Logits of a segment that continues ``past`` (per layer (K, V) of every earlier token),
        and the segment's own per-layer (K, V). Differentiable in ``past`` too."""
        num_past = 0 if not past else past[0][0].shape[2]
        L = tokens_BL.shape[1]
        if num_past + L > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {num_past + L} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}"
            )
        positions = torch.arange(num_past, num_past + L, device=tokens_BL.device)
        x = self.embed(tokens_BL) + self.pos(positions)
        kv = []
        for i, block in enumerate(self.blocks):
            x, layer_kv = block(x, past[i] if past else None)
            kv.append(layer_kv)
        return self.lm_head(self.norm(x)), kv


def build_torch_decoder(cfg: DecoderConfig, seed: int = 0) -> TorchDecoder:
    dtype = {"float32": torch.float32, "float64": torch.float64}[cfg.dtype]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = TorchDecoder(cfg)
        for p in model.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.5 / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.5)
    return model.to(dtype)
