"""Grouped-GEMM experts (``learner.moe.grouped_gemm``) load, export and push through the HF mapping.

Megatron builds a MoE layer's experts as the legacy ``GroupedMLP`` on the local spec (two fused
parameters, ``weight1`` / ``weight2``) and as ``TEGroupedMLP`` on the Transformer Engine spec (one
``weight<e>`` per expert in TE's ``GroupedLinear``); ``megathunder.learner.hf.named_params`` maps both
onto the per-expert canonical names. Here, on CPU and in one process:

- the legacy ``GroupedMLP`` is Megatron's own module, built with a torch stand-in for the
  ``grouped_gemm`` package's kernel (``gmm``: expert e's rows times ``w[e]``): an HF checkpoint
  goes in and comes out bit for bit, and the loaded module's forward equals each expert's HF
  SwiGLU computed from the HF tensors (so the transposes and the gate/up halves are the right ones);
- ``TEGroupedMLP`` cannot be built without Transformer Engine: its parameter names are taken from
  Megatron's source (the ``weight{gemm_idx}`` it reads) and from TE's convention (out x in), put on a
  stand-in module of those names and shapes, and round-tripped the same way.

The rest of the model is plain parameters under the canonical names (their mapping is tested
elsewhere); the experts are what is new. Without the mapping every one of these fails with
"parameters ... have no HF mapping".
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megathunder.config import PolicyModelConfig
from megathunder.learner import hf
from megathunder.learner.parallel import ParallelDims, ProcessGroups

NUM_EXPERTS, HIDDEN, FFN = 4, 32, 16
PGS = ProcessGroups(ParallelDims(1, 1, 1), 0, 1, 0, 0, 0, SimpleNamespace(tp=None), torch.device("cpu"))
"""One rank: no collective runs (a one-rank TP group is only named, never used)."""


def _model_cfg() -> PolicyModelConfig:
    return PolicyModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=HIDDEN, ffn_hidden_size=48, num_layers=2,
                             num_attention_heads=8, num_query_groups=4, head_dim=8, tie_word_embeddings=False,
                             num_experts=NUM_EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=FFN)


def _random_hf(m: PolicyModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g) for name, shape in hf.hf_stage_layout(m, 1, 0)}


def _put(root: torch.nn.Module, path: str, value: torch.nn.Module | torch.nn.Parameter) -> None:
    """Place a module or parameter at dotted ``path`` under ``root``, making the modules between."""
    *heads, leaf = path.split(".")
    node = root
    for head in heads:
        if not hasattr(node, head):
            node.add_module(head, torch.nn.Module())
        node = getattr(node, head)
    if isinstance(value, torch.nn.Parameter):
        node.register_parameter(leaf, value)
    else:
        node.add_module(leaf, value)


def _model(m: PolicyModelConfig, experts) -> torch.nn.Module:
    """Every non-expert parameter at its canonical name and Megatron shape; ``experts(layer)``: the
    experts module of each layer."""
    src = hf.InMemorySource(_random_hf(m))
    root = torch.nn.Module()
    for key in hf.megatron_keys(m, 1, 0):
        if hf.expert_index(key) is None:
            _put(root, key, torch.nn.Parameter(torch.zeros(hf.read_shard(src, key, m, 1, 0).shape)))
    for layer in range(m.num_layers):
        _put(root, f"decoder.layers.{layer}.mlp.experts", experts(layer))
    return root


class _Group:
    """A one-rank process group as Megatron's expert modules ask it (``size``, ``rank``)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """grouped_gemm's ``ops.gmm``: expert e's rows of ``a`` times ``b[e]`` (``b[e]^T`` with trans_b)."""
    rows = a.split(batch_sizes.tolist())
    return torch.cat([r @ (b[e].t() if trans_b else b[e]) for e, r in enumerate(rows)])


@pytest.fixture
def legacy_grouped_mlp(monkeypatch):
    """Megatron's ``GroupedMLP`` constructor for this model, its grouped GEMM done by ``_gmm``."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import experts, grouped_gemm_util

    monkeypatch.setattr(grouped_gemm_util, "grouped_gemm", SimpleNamespace(ops=SimpleNamespace(gmm=_gmm)))
    monkeypatch.setattr(grouped_gemm_util, "ops", SimpleNamespace(gmm=_gmm))
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=8, ffn_hidden_size=48,
                               num_moe_experts=NUM_EXPERTS, moe_ffn_hidden_size=FFN, moe_router_topk=2,
                               gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                               use_cpu_initialization=True, bf16=True, params_dtype=torch.float32,
                               moe_grouped_gemm=True)  # bf16: the flag its forward asserts; fp32 weights
    collection = SimpleNamespace(ep=_Group(), expt_tp=_Group(), expt_dp=_Group())
    return lambda _layer: experts.GroupedMLP(NUM_EXPERTS, config, pg_collection=collection)


class _TEGroupedLinear(torch.nn.Module):
    """Transformer Engine's ``GroupedLinear`` as Megatron reads it: ``weight<i>`` per GEMM, out x in."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int) -> None:
        super().__init__()
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.zeros(out_features, in_features)))


class _TEGroupedMLP(torch.nn.Module):
    """``TEGroupedMLP``'s submodules: ``linear_fc1`` (H -> 2F, GLU) and ``linear_fc2`` (F -> H)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_fc1 = _TEGroupedLinear(NUM_EXPERTS, HIDDEN, 2 * FFN)
        self.linear_fc2 = _TEGroupedLinear(NUM_EXPERTS, FFN, HIDDEN)


def _round_trip(model: torch.nn.Module, m: PolicyModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    hf.load_hf(model, "unused", m, PGS, 0, src=hf.InMemorySource(tensors))
    out = {name: view.reshape(shape).clone() for name, shape, view in hf.stage_hf_tensors(model, m, PGS, 0)}
    assert out.keys() == tensors.keys()
    for name, value in out.items():
        assert torch.equal(value, tensors[name]), name


def test_legacy_grouped_mlp_round_trips_bit_exact(legacy_grouped_mlp):
    m = _model_cfg()
    tensors = _random_hf(m)
    model = _model(m, legacy_grouped_mlp)
    assert {"decoder.layers.0.mlp.experts.weight1", "decoder.layers.0.mlp.experts.weight2"} <= set(model.state_dict())
    _round_trip(model, m, tensors)


def test_legacy_grouped_mlp_loaded_computes_each_hf_expert(legacy_grouped_mlp):
    """The loaded module's forward (Megatron's code: views, gmm, its GLU) against HF's SwiGLU expert
    ``down(silu(gate x) * up x) * prob`` from the HF tensors, expert by expert."""
    m = _model_cfg()
    tensors = _random_hf(m)
    model = _model(m, legacy_grouped_mlp)
    hf.load_hf(model, "unused", m, PGS, 0, src=hf.InMemorySource(tensors))
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(int(counts.sum()), HIDDEN, generator=g)
    probs = torch.rand(x.shape[0], generator=g)
    with torch.no_grad():
        got, _ = model.get_submodule("decoder.layers.1.mlp.experts")(x, counts, probs)
    expected = []
    for e, rows, p in zip(range(NUM_EXPERTS), x.split(counts.tolist()), probs.split(counts.tolist()), strict=True):
        w = {n: tensors[f"model.layers.1.mlp.experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down")}
        expected.append((F.silu(rows @ w["gate"].T) * (rows @ w["up"].T) * p[:, None]) @ w["down"].T)
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_legacy_grouped_mlp_gradient_buffers_map_like_the_parameters(legacy_grouped_mlp):
    """``source="main_grad"`` (the tests' gradient gathers) splits the fused gradient buffer by the
    same views as the parameter."""
    m = _model_cfg()
    model = _model(m, legacy_grouped_mlp)
    for name, param in model.named_parameters():
        param.main_grad = torch.arange(param.numel(), dtype=torch.float32).view(param.shape)
    params, grads = hf.stage_params(model, m, 0), hf.stage_params(model, m, 0, source="main_grad")
    key = "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight"
    assert params[key].shape == grads[key].shape == (HIDDEN, FFN)
    fused = model.get_parameter("decoder.layers.0.mlp.experts.weight2")
    assert torch.equal(grads[key], fused.main_grad.view(NUM_EXPERTS, FFN, HIDDEN)[2].t())
    assert params[key].data_ptr() == fused[2 * FFN:].data_ptr()  # a view: loading writes the fused storage


def test_te_grouped_mlp_names_are_megatrons_and_round_trip_bit_exact():
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer.moe import experts

    source = inspect.getsource(transformer_engine)
    assert 'full_state_dict[f"weight{gemm_idx}"]' in source  # TEGroupedLinear's per-GEMM weights
    mlp = inspect.getsource(experts.TEGroupedMLP.__init__)
    assert "self.linear_fc1 = build_module(" in mlp and "self.linear_fc2 = build_module(" in mlp
    m = _model_cfg()
    tensors = _random_hf(m)
    model = _model(m, lambda _layer: _TEGroupedMLP())
    assert "decoder.layers.1.mlp.experts.linear_fc2.weight3" in model.state_dict()
    _round_trip(model, m, tensors)
    assert (hf._canonical("decoder.layers.1.mlp.experts.linear_fc1.weight12")
            == "decoder.layers.1.mlp.experts.local_experts.12.linear_fc1.weight")
