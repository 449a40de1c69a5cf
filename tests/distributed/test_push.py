"""The weight push from a TP=2 x PP=2 learner: each stage's sender streams its own buckets; what
two (fake) vLLM workers reload equals the learner's own HF export bit for bit, dense and sparse."""

from __future__ import annotations

import pytest
import torch

from pathlib import Path

from tests.distributed.conftest import launch

WORKER = Path(__file__).with_name("push_worker.py")

WORKER_ARGS = ["--tp", "2", "--pp", "2", "--bucket-kb", "4"]


@pytest.mark.parametrize("dtype,sparse,lr", [("float32", 0.0, "1e-3"), ("bfloat16", 0.5, "1e-5")],
                         ids=["dense_fp32", "sparse_bf16"])
def test_tp2_pp2_push_equals_the_export_bit_for_bit(hf_qwen2, tmp_path, dtype, sparse, lr):
    """Sparse: Adam at lr 1e-5 on weights of std 0.02 moves most of them by less than half a bf16
    step (2^-9 relative), so a quarter or fewer of the bf16 values change per step."""
    out = tmp_path / "push.pt"
    launch(4, "push", "--out", str(out), "--hf", str(hf_qwen2), "--dtype", dtype, "--sparse", str(sparse),
           "--lr", lr, *WORKER_ARGS, worker=WORKER, mode_arg=False)
    result = torch.load(out)
    pushes = result["pushes"]
    assert result["events"] == ["open", *(["pause", "receive", "resume"] * 3)]  # WeightSync: connect, then pushes
    for push in pushes:
        assert push["names_equal"] == [True, True] and push["bit_exact"] == [True, True], push
        assert push["stats"]["num_frames"] > 4  # 4 KiB buckets: many frames, from both stages
    first, *later = (p["stats"] for p in pushes)
    assert first["num_sparse_tensors"] == 0 and first["changed_fraction"] == 1.0  # nothing to compare with
    if sparse:
        assert any(s["num_sparse_tensors"] > 0 for s in later)  # bf16 rounding hides most updates
        assert all(s["payload_bytes"] < s["dense_bytes"] for s in later)
        assert all(0 < s["changed_fraction"] < 0.5 for s in later)
    else:
        assert all(s["payload_bytes"] == s["dense_bytes"] for s in later)


def test_moe_tp2_pp2_ep2_push_equals_the_export_bit_for_bit(hf_qwen3_moe, tmp_path):
    """A Qwen3-MoE at TP=2 x PP=2 with expert parallelism 2: every expert reaches the workers in HF
    names from the rank that holds it, bit-identical to the export, dense then sparse (bf16)."""
    out = tmp_path / "push.pt"
    launch(4, "push", "--out", str(out), "--hf", str(hf_qwen3_moe), "--dtype", "bfloat16", "--sparse", "0.5",
           "--lr", "1e-5", "--parallel", '{"sequence_parallel": true, "expert_parallel": 2}', *WORKER_ARGS,
           worker=WORKER, mode_arg=False)
    pushes = torch.load(out)["pushes"]
    for push in pushes:
        assert push["names_equal"] == [True, True] and push["bit_exact"] == [True, True], push
    assert any(s["num_sparse_tensors"] > 0 for s in (p["stats"] for p in pushes[1:]))


def test_moe_dp2_ep2_push_equals_the_export_bit_for_bit(hf_qwen3_moe, tmp_path):
    """Expert parallelism across the two data-parallel ranks (TP=1): half the experts live on DP rank 1,
    which takes part in their gathers (and only theirs) onto the sender, DP rank 0."""
    out = tmp_path / "push.pt"
    launch(2, "push", "--out", str(out), "--hf", str(hf_qwen3_moe), "--dtype", "bfloat16", "--sparse", "0.5",
           "--lr", "1e-5", "--parallel", '{"expert_parallel": 2}', "--bucket-kb", "4", worker=WORKER, mode_arg=False)
    pushes = torch.load(out)["pushes"]
    for push in pushes:
        assert all(push["names_equal"]) and all(push["bit_exact"]), push
    assert any(s["num_sparse_tensors"] > 0 for s in (p["stats"] for p in pushes[1:]))
