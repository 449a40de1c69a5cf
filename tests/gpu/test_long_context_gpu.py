"""Context parallelism (and sequence parallelism) on Transformer Engine's spec, which only runs on
GPUs: the streamed and batch gradients of a CP=2 (and a TP=2 + SP) learner equal one GPU's without
them, within bf16 tolerance. Needs two GPUs and Transformer Engine; skipped otherwise, with the
reason. (On CPU the local spec's SP and recompute are checked in fp32:
``tests/distributed/test_learner.py``.)"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.distributed.conftest import launch, make_hf_checkpoint

pytestmark = [
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="Transformer Engine not installed"),
]

BF16_TOL = 2e-2  # relative; bf16 forward/backward, fp32 gradient accumulation, reassociated sums
TE = {"precision": {"params_dtype": "bfloat16", "layer_spec": "transformer_engine"}}


def _flat(d):
    return torch.cat([d[k].reshape(-1).double() for k in sorted(d)])


@pytest.mark.gpu
@pytest.mark.parametrize("option", [{"parallel": {"context_parallel": 2}},
                                    {"parallel": {"tensor_parallel": 2, "sequence_parallel": True}}],
                         ids=["cp2", "tp2_sp"])
def test_context_and_sequence_parallel_gradients_equal_one_gpu(tmp_path, option):
    hf = make_hf_checkpoint(tmp_path / "hf", "qwen2", tie=True)
    runs = {}
    for name, nproc, extra in (("one", 1, {}), ("option", 2, option)):
        runs[name] = tmp_path / f"{name}.pt"
        learner = {**TE, **extra}
        launch(nproc, "equivalence", "--out", str(runs[name]), "--hf", str(hf), "--optimizer", "sgd",
               "--learner", json.dumps(learner))
    one, other = torch.load(runs["one"]), torch.load(runs["option"])
    reference = _flat(one["sync_grad"])
    for path in ("stream_grad", "sync_grad"):
        err = ((_flat(other[path]) - reference).norm() / reference.norm()).item()
        assert err <= BF16_TOL, (path, err)
