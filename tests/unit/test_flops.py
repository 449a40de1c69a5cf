"""The one FLOPs formula (``megathunder.plan.flops``) that ``bench learner``, ``sweep`` and the
trainer's per-step MFU share: 6 N + 12 L h s a token for the model, plus what recomputation
repeats for the hardware; a MoE counts the parameters a token goes through."""

from __future__ import annotations

import pytest

from megathunder.config import PolicyModelConfig
from megathunder.plan.flops import Utilisation, peak_tflops, training_flops, utilisation
from megathunder.plan.memory_plan import ModelShape


def _shape(**moe) -> ModelShape:
    return ModelShape.of(PolicyModelConfig(vocab_size=1000, hidden_size=64, ffn_hidden_size=256, num_layers=4,
                                           num_attention_heads=8, num_query_groups=4, **moe))


def test_model_flops_are_six_n_plus_twelve_l_h_s_a_token_and_recompute_adds_what_it_repeats():
    shape, lengths = _shape(), [10, 30]
    n, lh = shape.num_params, 4 * 64
    model = sum(s * (6 * n + 12 * lh * s) for s in lengths)
    assert training_flops(shape, lengths).model == training_flops(shape, lengths).hardware == model
    assert training_flops(shape, lengths, "full").hardware == model + sum(s * (2 * n + 4 * lh * s) for s in lengths)
    assert training_flops(shape, lengths, "selective").hardware == model + sum(s * 4 * lh * s for s in lengths)
    assert training_flops(shape, lengths, "full").model == model  # MFU never counts recomputation


def test_a_moe_counts_the_parameters_a_token_goes_through():
    moe = _shape(family="qwen3_moe", num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32)
    assert moe.active_params < moe.num_params
    assert training_flops(moe, [1]).model == 6 * moe.active_params + 12 * 4 * 64


def test_utilisation_is_flops_over_seconds_devices_and_peak():
    assert utilisation(2e12, 2.0, 4, 0.25) == pytest.approx(1.0)
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("cpu") is None
    u = Utilisation(_shape(), "full", devices=2, peak=1e-6)
    cols = u.columns([10, 30], 1.5)
    f = training_flops(_shape(), [10, 30], "full")
    assert cols == pytest.approx({"mfu": f.model / (1.5 * 2 * 1e6), "hfu": f.hardware / (1.5 * 2 * 1e6)})
    assert cols["hfu"] > cols["mfu"]
