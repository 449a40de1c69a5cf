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

from megathunder.config import ModelConfig


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.attn_norm = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d)
        self.gate_up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        B, L, D = x_BLD.shape
        q, k, v = self.qkv(self.attn_norm(x_BLD)).split(D, dim=-1)
        q, k, v = (t.view(B, L, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x_BLD = x_BLD + self.proj(attn.transpose(1, 2).reshape(B, L, D))
        gate, up = self.gate_up(self.mlp_norm(x_BLD)).chunk(2, dim=-1)
        return x_BLD + self.down(F.silu(gate) * up)


class TorchDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens_BL: torch.Tensor) -> torch.Tensor:
        """Logits [B, L, V] for every position (position t predicts token t + 1)."""
        L = tokens_BL.shape[1]
        if L > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {L} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}")
        x = self.embed(tokens_BL) + self.pos(torch.arange(L, device=tokens_BL.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def build_torch_decoder(cfg: ModelConfig, seed: int = 0) -> TorchDecoder:
    dtype = {"float32": torch.float32, "float64": torch.float64}[cfg.dtype]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = TorchDecoder(cfg)
        for p in model.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.5 / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.5)
    return model.to(dtype)
