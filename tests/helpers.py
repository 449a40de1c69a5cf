"""Shared test machinery: run a batch through the ledger in a given event order."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from megathunder.streaming import synthetic as syn

from megathunder.trajectory import batch_plan
from megathunder.config import LedgerConfig, DecoderConfig, RLObjective
from megathunder.models.torch_decoder import TorchDecoder, build_torch_decoder
from megathunder.streaming import BatchResult, GradientLedger, TorchBackend
from megathunder.trajectory import Trajectory

VOCAB = 32
MAX_LEN = 40


def small_model(dtype: str = "float64", seed: int = 0) -> TorchDecoder:
    cfg = DecoderConfig(
        vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, max_seq_len=MAX_LEN, dtype=dtype
    )
    return build_torch_decoder(cfg, seed=seed)


def streamed_gradient(
    model: torch.nn.Module,
    batch: Sequence[Trajectory],
    rewards: Sequence[float],
    objective: RLObjective,
    ledger_cfg: LedgerConfig,
    events: Sequence[syn.Event],
    *,
    reward_shift: bool = True,
) -> tuple[torch.Tensor, BatchResult, GradientLedger]:
    backend = TorchBackend(model, objective)
    ledger = GradientLedger(backend, objective, ledger_cfg, reward_shift=reward_shift)
    ledger.begin_batch(batch_plan(batch))
    syn.feed_events(ledger, batch, rewards, events)
    result = ledger.close_batch()
    return backend.live.flat().clone(), result, ledger


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


def make_case(seed: int, dtype: torch.dtype, reward_kind: str | None = None):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 8) for _ in range(rng.randint(2, 5))]
    batch = syn.random_batch(rng, sizes, VOCAB, MAX_LEN, dtype)
    kind = reward_kind or rng.choice(["binary", "continuous", "large_offset"])
    rewards = syn.random_rewards(rng, batch, kind)
    return rng, batch, rewards
