"""HF checkpoints a slice at a time: the shards read per TP rank, the HF views of stacked shards, the
streaming safetensors writer and the lazy reader -- each against whole-tensor references, bitwise."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from megathunder.config import PolicyModelConfig
from megathunder.learner import hf
from megathunder.learner.safetensors_io import CheckpointReader, StreamingWriter


def _model(family: str, tie: bool) -> PolicyModelConfig:
    return PolicyModelConfig(family=family, vocab_size=64, hidden_size=32, ffn_hidden_size=48, num_layers=4,
                             num_attention_heads=8, num_query_groups=4, head_dim=8, tie_word_embeddings=tie)


def _random_hf(m: PolicyModelConfig, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g).to(dtype)
            for s in range(m.num_layers) for name, shape in hf.hf_stage_layout(m, m.num_layers, s)}


@pytest.mark.parametrize("family,tie", [("qwen2", False), ("qwen3", True), ("llama", False)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_read_per_rank_stack_back_to_the_hf_tensors(family, tie, tp):
    """read_shard on every TP rank, stacked as a gather would, then hf_views: the HF tensors."""
    m = _model(family, tie)
    tensors = _random_hf(m)
    src = hf.InMemorySource(tensors)
    seen = set()
    for stage in range(2):
        for key in hf.megatron_keys(m, 2, stage):
            shards = [hf.read_shard(src, key, m, tp, r) for r in range(tp)]
            stacked = torch.stack(shards) if hf._tp_rule(key) is not None else shards[0][None]
            for name, shape, view in hf.hf_views(key, stacked, m):
                assert torch.equal(view.reshape(shape), tensors[name]), name
                flat = torch.empty(math.prod(shape))
                flat.view(view.shape).copy_(view)  # how a bucket is packed
                assert torch.equal(flat.view(shape), tensors[name]), name
                seen.add(name)
    assert seen == set(tensors)


def test_fused_qkv_shard_is_megatron_group_major_layout():
    """The fused QKV shard of rank r: query groups of r, each [its q heads; k; v] (Megatron's)."""
    m = _model("qwen2", False)
    tensors = _random_hf(m)
    hd, qpg = 8, 2
    key = "decoder.layers.1.self_attention.linear_qkv.weight"
    got = hf.read_shard(hf.InMemorySource(tensors), key, m, 2, 1)
    q, k, v = (tensors[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    expected = torch.cat([torch.cat([q[g * qpg * hd:(g + 1) * qpg * hd], k[g * hd:(g + 1) * hd],
                                     v[g * hd:(g + 1) * hd]]) for g in (2, 3)])
    assert torch.equal(got, expected)


def test_megatron_keys_cover_every_hf_tensor_once_across_stages():
    m = _model("qwen2", False)
    names = [n for s in range(4) for n, _ in hf.hf_stage_layout(m, 4, s)]
    assert len(names) == len(set(names)) == 2 + 1 + 4 * 12  # embed, norm, lm_head, 12 per layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streaming_writer_matches_safetensors_and_the_reader_slices(tmp_path, dtype):
    tensors = {"a": torch.randn(5, 7).to(dtype), "b": torch.randn(3).to(dtype), "c": torch.randn(0, 2).to(dtype),
               "d": torch.randn(4, 6).to(dtype)}
    path = tmp_path / "streamed.safetensors"
    with StreamingWriter(path, [(n, t.shape, t.dtype) for n, t in tensors.items()]) as w:
        for n, t in tensors.items():
            w.write(n, t.t().contiguous().t())  # a non-contiguous input is copied
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[n], t) for n, t in tensors.items())
    reference = tmp_path / "ref.safetensors"
    save_file(tensors, str(reference))
    reader = CheckpointReader(tmp_path)  # both files: the names are the same, the later file wins
    assert torch.equal(reader.rows("a", 1, 3), tensors["a"][1:3])
    assert torch.equal(reader.cols("d", 2, 5), tensors["d"][:, 2:5])
    assert reader.shape("a") == (5, 7)


def test_streaming_writer_rejects_a_tensor_out_of_order(tmp_path):
    w = StreamingWriter(tmp_path / "x.safetensors", [("a", (2,), torch.float32), ("b", (3,), torch.float32)])
    with pytest.raises(ValueError, match="expects a"):
        w.write("b", torch.zeros(3))
    with pytest.raises(ValueError, match="never written"):
        w.close()


def _moe_model(family: str = "qwen3_moe") -> PolicyModelConfig:
    shared = dict(moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True) if family == "qwen2_moe" else {}
    return PolicyModelConfig(family=family, vocab_size=64, hidden_size=32, ffn_hidden_size=48, num_layers=2,
                             num_attention_heads=8, num_query_groups=4, head_dim=8, tie_word_embeddings=False,
                             num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, **shared)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("tp,etp", [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)])
def test_moe_shards_read_per_rank_stack_back_to_the_hf_tensors(tp, etp, family):
    """Qwen3-MoE, Qwen2-MoE and Mixtral: dense parameters (Qwen2-MoE's shared expert too) split over
    TP, each expert's over the expert-tensor ranks (gate/up rows, down columns), the router and the
    shared expert's gate replicated; stacked, the HF tensors, one per expert."""
    m = _moe_model(family)
    tensors = _random_hf(m)
    if family == "mixtral":
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in tensors
    else:
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in tensors and "model.layers.0.mlp.gate.weight" in tensors
    src = hf.InMemorySource(tensors)
    seen = set()
    for stage in range(2):
        for key in hf.megatron_keys(m, 2, stage):
            n = etp if hf.expert_index(key) is not None else tp
            shards = [hf.read_shard(src, key, m, n, r) for r in range(n)]
            stacked = torch.stack(shards) if hf._tp_rule(key) is not None else shards[0][None]
            for name, shape, view in hf.hf_views(key, stacked, m):
                assert torch.equal(view.reshape(shape), tensors[name]), name
                seen.add(name)
    assert seen == set(tensors)
    qk_norms = 2 if family == "qwen3_moe" else 0
    qkv_biases = 3 if family == "qwen2_moe" else 0
    shared = 4 if family == "qwen2_moe" else 0  # gate, up, down, the gate of its output
    if shared:
        assert tensors["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 32)
    # embed, norm, lm_head; per layer: attention and norms, router, experts, shared expert
    assert len(tensors) == 2 + 1 + 2 * (6 + qk_norms + qkv_biases + 1 + 4 * 3 + shared)


def test_moe_expert_names_map_local_to_global_indices():
    assert hf.expert_index("decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight") == 5
    assert hf.expert_index("decoder.layers.3.mlp.router.weight") is None
    assert (hf._local_to_global("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", 2, 4)
            == "decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight")
