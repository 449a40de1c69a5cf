"""FP8 padding is exact: a learner whose trajectories are padded to the FP8 multiple (16 tokens per
rank's GEMMs, ``ParallelDims.seq_multiple`` with ``token_align``) computes the same gradient and
logprobs as with its layout's own multiple. Forced with FP8 off (CPUs have no FP8 GEMMs), so the
comparison isolates the padding: attention is causal and the pads' targets are cut before the
loss, so the pads reach nothing; what differs is the GEMMs' shapes, hence fp32 summation order --
the tolerances are the packed-vs-unpacked ones (``test_learner.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.conftest import launch
from tests.distributed.test_learner import GRAD_TOL, LOGP_TOL, _flat, _rel

WORKER = __file__.replace("test_fp8_padding.py", "fp8_padding_worker.py")


@pytest.mark.parametrize("layout", [(1, {}), (2, {"parallel": {"sequence_parallel": True}})], ids=["single", "tp2_sp"])
def test_padding_to_the_fp8_multiple_leaves_gradient_and_logprobs_unchanged(hf_qwen2, tmp_path, layout):
    from pathlib import Path

    nproc, learner = layout
    out = tmp_path / "pad.pt"
    launch(nproc, "fp8_padding", "--hf", str(hf_qwen2), "--out", str(out), "--tp", str(nproc),
           "--learner", json.dumps(learner), worker=Path(WORKER), mode_arg=False)
    run = torch.load(out)
    assert run["fp8_multiple"] == 16 and run["own_multiple"] == nproc  # lcm(tp under SP, 16)
    assert all(w % 16 == 0 for w in run["fp8_widths"]), run["fp8_widths"]
    assert any(w % 16 for w in run["own_widths"])  # the own layout pads less: the comparison means something
    assert _rel(_flat(run["fp8_grad"]), _flat(run["own_grad"])) <= GRAD_TOL
    for padded, own in zip(run["fp8_logp"], run["own_logp"], strict=True):
        torch.testing.assert_close(padded, own, rtol=0, atol=LOGP_TOL)
