"""Host-placed ledger slots on a GPU learner (``ledger.slot_placement=host``: pinned host memory, the
copy on a side CUDA stream, the adds on the pool's thread) give the streamed gradient of device
slots (``tools/gpu_check.sh``); skipped on CPU, where the two are bitwise equal
(``tests/unit/test_ledger_memory.py``).

On a GPU the host adds run on the CPU's kernels and the device ones on the GPU's, so the same fp32
adds may round differently (a fused multiply-add rounds once, a multiply then an add twice): each
slot add differs by at most one fp32 ulp of its result, a slot receives at most a group's few
trajectories, so the gradients agree to a few ulps relative -- 1e-6 is ~8 ulps. bf16 slots round
each add to 8 bits wherever it runs: within the bf16 slot bound (docs/exactness.md 2.7), far
below BF16 below."""

from __future__ import annotations

import os
import random

import pytest
import torch

from tests.gpu_helpers import record

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FP32_SLOTS_RTOL = 1e-6
BF16_SLOTS_RTOL = 1e-2

MODEL = {"vocab_size": 1024, "hidden_size": 256, "ffn_hidden_size": 1024, "num_layers": 2,
         "num_attention_heads": 4, "num_query_groups": 2, "tie_word_embeddings": False}


def _streamed(ledger: dict) -> tuple[torch.Tensor, dict]:
    from megathunder.config import GRPOObjective, LearnerConfig, LedgerConfig
    from megathunder.learner.learner import MegatronLearner
    from megathunder.learner.parallel import destroy_distributed, init_distributed
    from megathunder.streaming import synthetic as syn
    from megathunder.trajectory import batch_plan

    os.environ.setdefault("MASTER_PORT", "29557")
    cfg = LearnerConfig.model_validate({"model": MODEL, "precision": {"params_dtype": "bfloat16"}})
    pgs = init_distributed(cfg)
    try:
        learner = MegatronLearner.build(cfg, GRPOObjective(kl_coef=0.0, entropy_coef=0.001), pgs,
                                        LedgerConfig(max_group_slots=2, **ledger))
        rng = random.Random(0)
        batch = syn.random_batch(rng, [4, 4, 4], MODEL["vocab_size"], 128, empty_prob=0.0)
        rewards = syn.random_rewards(rng, batch, "continuous")
        events = syn.random_event_order(rng, len(batch))
        led = learner.ledger
        led.begin_batch(batch_plan(batch))
        syn.feed_events(led, batch, rewards, events)
        result = led.close_batch()
        pool = led.pool
        mover = pool._mover
        info = {"peak_host_bytes": result.peak_host_bytes, "peak_buffers": result.peak_buffers,
                "pinned": mover is not None and all(t.is_pinned() for t in mover.host_stage.tensors),
                "side_stream": mover is not None and mover.cuda}
        return learner.backend.live.flat().float().clone().cpu(), info
    finally:
        destroy_distributed()


@pytest.mark.gpu
@pytest.mark.parametrize("slot_dtype,rtol", [("gradient", FP32_SLOTS_RTOL), ("bfloat16", BF16_SLOTS_RTOL)])
def test_host_slots_give_the_device_slots_gradient_on_cuda(slot_dtype, rtol):
    device, _ = _streamed({"slot_dtype": slot_dtype})
    host, info = _streamed({"slot_dtype": slot_dtype, "slot_placement": "host"})
    err = ((host - device).norm() / device.norm()).item()
    record(f"ledger_host_slots_{slot_dtype}", rel_err=err, bound=rtol, **info)
    assert info["peak_buffers"] > 1 and info["peak_host_bytes"] > 0  # slots were used, in host memory
    assert info["pinned"] and info["side_stream"]  # pinned staging, copied on a CUDA side stream
    assert device.norm() > 0 and err <= rtol, err
