"""Hugging Face checkpoints (safetensors + config.json) in and out of the sharded Megatron policy,
a tensor at a time: no rank ever reads, gathers or holds the whole model.

Name and layout mapping for the Llama / Qwen2 / Qwen3 family (Megatron local-spec names; the TE
spec fuses the two norms into the following linear layers):

    model.embed_tokens.weight                  embedding.word_embeddings.weight      vocab-sharded
    model.layers.i.input_layernorm.weight      decoder.layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj.*    decoder.layers.i.self_attention.linear_qkv.*
        fused per query group: [q heads of group g; k_g; v_g] for g in groups; sharded by group
    model.layers.i.self_attn.{q,k}_norm.weight decoder.layers.i.self_attention.{q,k}_layernorm.weight
    model.layers.i.self_attn.o_proj.weight     decoder.layers.i.self_attention.linear_proj.weight  (input dim)
    model.layers.i.post_attention_layernorm    decoder.layers.i.pre_mlp_layernorm.weight
    model.layers.i.mlp.{gate,up}_proj.weight   decoder.layers.i.mlp.linear_fc1.weight
        [gate; up], each sharded separately: rank r holds [gate_r; up_r]
    model.layers.i.mlp.down_proj.weight        decoder.layers.i.mlp.linear_fc2.weight    (input dim)
    model.norm.weight                          decoder.final_layernorm.weight
    lm_head.weight (untied)                    output_layer.weight                   vocab-sharded

Qwen3-MoE layers (Megatron's MoE layer on the local spec: router + SequentialMLP experts):

    model.layers.i.mlp.gate.weight             decoder.layers.i.mlp.router.weight    replicated
    model.layers.i.mlp.experts.e.{gate,up}_proj.weight
                                               decoder.layers.i.mlp.experts.local_experts.e.linear_fc1.weight
        [gate; up] as a dense MLP's, sharded over the expert-tensor-parallel ranks
    model.layers.i.mlp.experts.e.down_proj.weight
                                               decoder.layers.i.mlp.experts.local_experts.e.linear_fc2.weight
        input dim sharded over the expert-tensor-parallel ranks

Mixtral names the same tensors ``model.layers.i.block_sparse_moe.gate.weight`` and
``...block_sparse_moe.experts.e.{w1,w3,w2}.weight`` (gate, up, down). Qwen2-MoE names them as
Qwen3-MoE does and adds a shared expert (Megatron's ``SharedExpertMLP``, TP-sharded as a dense MLP):

    model.layers.i.mlp.shared_expert.{gate,up}_proj.weight
                                               decoder.layers.i.mlp.shared_experts.linear_fc1.weight
    model.layers.i.mlp.shared_expert.down_proj.weight
                                               decoder.layers.i.mlp.shared_experts.linear_fc2.weight
    model.layers.i.mlp.shared_expert_gate.weight
                                               decoder.layers.i.mlp.shared_experts.gate_weight   replicated

Grouped-GEMM experts (``learner.moe.grouped_gemm``) hold the same per-expert tensors under other
names; they are mapped onto the canonical names above by :func:`named_params` (derivation there):

    TEGroupedMLP (TE spec)    ...mlp.experts.linear_fc1.weight<e>   = local_experts.e.linear_fc1.weight
                              ...mlp.experts.linear_fc2.weight<e>   = local_experts.e.linear_fc2.weight
    GroupedMLP (local spec)   ...mlp.experts.weight1 [H, E_l * 2F]  viewed [E_l, H, 2F]: expert e's fc1, transposed
                              ...mlp.experts.weight2 [E_l * F, H]   viewed [E_l, F, H]: expert e's fc2, transposed

Expert indices are global in the canonical names, as layer indices are: expert-parallel rank ``r``
holds experts ``[r * E/ep, (r+1) * E/ep)`` as its ``local_experts.0 ..``, so it reads only those
experts' tensors (and only its expert-tensor slice of each). Because the expert grid refines the
tensor-parallel group (ep x etp = tp, ``megathunder.config.ParallelConfig``), every shard of every
expert of a stage lies on one TP group: out, each expert parameter is gathered onto TP rank 0 from
the ranks that hold it (:func:`gather_param`), like a dense one.

Every TP shard is a contiguous range of the HF tensors it comes from: query groups
``[r * G/tp, (r+1) * G/tp)`` are rows of q, k and v; rows ``[r * F/tp, (r+1) * F/tp)`` of gate and
of up; a row range of the vocabulary; a column range of o_proj / down_proj. So

- **loading** (:func:`load_hf`) reads, per parameter, exactly this rank's ranges of the HF tensors
  (:class:`~megathunder.learner.safetensors_io.CheckpointReader`, safetensors' ``get_slice``) and
  only for this pipeline stage's layers: peak host memory is the rank's shard plus one tensor;
- **out** (:func:`stage_hf_tensors`) a stage gathers one parameter at a time onto its TP rank 0, in
  a ``[tp, *shard]`` buffer, and hands out the HF tensors as *views* of that buffer whose row-major
  element order is the HF tensor's (:func:`hf_views`): the consumer -- a bucket being packed for a
  weight push, a safetensors file being written -- copies each into place once. Peak: one gathered
  parameter on TP rank 0, nothing extra elsewhere.

Conversion is slicing and concatenation only, so import followed by export is bit-exact.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from megathunder.config import PolicyModelConfig
from megathunder.learner.parallel import ProcessGroups
from megathunder.learner.safetensors_io import INDEX_NAME, CheckpointReader, StreamingWriter, write_index

_TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}

HFView = tuple[str, tuple[int, ...], torch.Tensor]
"""(HF name, HF shape, a tensor whose row-major elements are the HF tensor's: copy it with
``dst.view(view.shape).copy_(view)`` or materialise it with ``view.reshape(shape)``)."""


def _head_dim(m: PolicyModelConfig) -> int:
    return m.head_dim or m.hidden_size // m.num_attention_heads


def _biases(m: PolicyModelConfig) -> tuple[str, ...]:
    return ("weight", "bias") if m.qkv_bias else ("weight",)


_EXPERTS = ".mlp.experts.local_experts."


def expert_index(key: str) -> int | None:
    """The expert of a canonical key (``...mlp.experts.local_experts.e...``), None for the rest."""
    if _EXPERTS not in key:
        return None
    return int(key.split(_EXPERTS, 1)[1].split(".", 1)[0])


def experts_per_rank(m: PolicyModelConfig, ep: int) -> int:
    assert m.num_experts is not None
    return m.num_experts // ep


def _is_local(key: str, m: PolicyModelConfig, pgs: ProcessGroups) -> bool:
    """Whether this rank holds (a slice of) parameter ``key``: every non-expert key of its stage,
    and the experts of its expert-parallel rank."""
    e = expert_index(key)
    return e is None or e // experts_per_rank(m, pgs.dims.ep) == pgs.ep_rank


def _shard_split(key: str, pgs: ProcessGroups) -> tuple[int, int]:
    """(how many shards, this rank's index) of parameter ``key``: the TP group for dense
    parameters, the expert-tensor-parallel ranks for experts."""
    return (pgs.dims.etp, pgs.etp_rank) if expert_index(key) is not None else (pgs.dims.tp, pgs.tp_rank)


# ---------------------------------------------------------------------------- layout by config


def stage_layers(m: PolicyModelConfig, pp: int, pp_rank: int) -> range:
    """Global indices of the transformer layers of pipeline stage ``pp_rank`` (split evenly)."""
    per = m.num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def megatron_keys(m: PolicyModelConfig, pp: int, pp_rank: int) -> list[str]:
    """The stage's parameters (canonical local-spec names, global layer indices) in the order they
    are loaded, exported and pushed; a tied last-stage output layer is the embedding and not listed."""
    keys = ["embedding.word_embeddings.weight"] if pp_rank == 0 else []
    for i in stage_layers(m, pp, pp_rank):
        p = f"decoder.layers.{i}."
        keys.append(p + "input_layernorm.weight")
        keys += [p + f"self_attention.linear_qkv.{s}" for s in _biases(m)]
        if m.qk_norm:
            keys += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        keys += [p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight"]
        if m.num_experts is None:
            keys += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
        else:
            keys.append(p + "mlp.router.weight")
            if m.moe_shared_expert_intermediate_size is not None:
                keys += [p + "mlp.shared_experts.linear_fc1.weight", p + "mlp.shared_experts.linear_fc2.weight"]
                if m.moe_shared_expert_gate:
                    keys.append(p + "mlp.shared_experts.gate_weight")
            for e in range(m.num_experts):
                keys += [p + f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                         p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"]
    if pp_rank == pp - 1:
        keys.append("decoder.final_layernorm.weight")
        if not m.tie_word_embeddings:
            keys.append("output_layer.weight")
    return keys


def hf_layout(key: str, m: PolicyModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """The HF tensors (name, shape) that Megatron parameter ``key`` holds, in order."""
    h, f, v, hd = m.hidden_size, m.ffn_hidden_size, m.vocab_size, _head_dim(m)
    nq, nkv = m.num_attention_heads * hd, m.num_query_groups * hd
    if key == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", (v, h))]
    if key == "output_layer.weight":
        return [("model.embed_tokens.weight" if m.tie_word_embeddings else "lm_head.weight", (v, h))]
    if key == "decoder.final_layernorm.weight":
        return [("model.norm.weight", (h,))]
    idx, rest = key[len("decoder.layers."):].split(".", 1)
    p = f"model.layers.{idx}."
    if rest.startswith("self_attention.linear_qkv."):
        s = rest.rsplit(".", 1)[1]
        tail = (h,) if s == "weight" else ()
        return [(p + f"self_attn.{n}_proj.{s}", (rows, *tail)) for n, rows in (("q", nq), ("k", nkv), ("v", nkv))]
    simple = {
        "input_layernorm.weight": ("input_layernorm.weight", (h,)),
        "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", (hd,)),
        "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", (hd,)),
        "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", (h, nq)),
        "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", (h,)),
        "mlp.linear_fc2.weight": ("mlp.down_proj.weight", (h, f)),
    }
    if rest == "mlp.linear_fc1.weight":
        return [(p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h))]
    block, (gate, up, down) = ("block_sparse_moe", ("w1", "w3", "w2")) if m.family == "mixtral" else (
        "mlp", ("gate_proj", "up_proj", "down_proj"))
    if rest == "mlp.router.weight":
        assert m.num_experts is not None
        return [(p + f"{block}.gate.weight", (m.num_experts, h))]
    if rest.startswith("mlp.shared_experts."):
        fs, q = m.moe_shared_expert_intermediate_size, p + "mlp.shared_expert."
        assert fs is not None
        if rest.endswith("linear_fc1.weight"):
            return [(q + "gate_proj.weight", (fs, h)), (q + "up_proj.weight", (fs, h))]
        if rest.endswith("linear_fc2.weight"):
            return [(q + "down_proj.weight", (h, fs))]
        return [(p + "mlp.shared_expert_gate.weight", (1, h))]
    e = expert_index(key)
    if e is not None:
        fe, q = m.expert_ffn_hidden_size, f"{p}{block}.experts.{e}."
        if rest.endswith("linear_fc1.weight"):
            return [(q + f"{gate}.weight", (fe, h)), (q + f"{up}.weight", (fe, h))]
        return [(q + f"{down}.weight", (h, fe))]
    name, shape = simple[rest]
    return [(p + name, shape)]


def hf_stage_layout(m: PolicyModelConfig, pp: int, pp_rank: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every HF tensor of the stage (name, shape), in :func:`stage_hf_tensors`' order."""
    return [entry for key in megatron_keys(m, pp, pp_rank) for entry in hf_layout(key, m)]


# ---------------------------------------------------------------------------- TP / PP sharding


def _tp_rule(name: str) -> str | None:
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")):
        return "rows"
    if name.endswith("linear_fc1.weight"):
        return "swiglu_rows"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "cols"
    return None  # replicated (norms)


def shard(name: str, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    rule = _tp_rule(name)
    if rule is None or tp == 1:
        return full
    if rule == "rows":
        return full.chunk(tp, dim=0)[tp_rank]
    if rule == "cols":
        return full.chunk(tp, dim=1)[tp_rank]
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    rule = _tp_rule(name)
    if rule is None or len(shards) == 1:
        return shards[0]
    if rule == "rows":
        return torch.cat(shards, dim=0)
    if rule == "cols":
        return torch.cat(shards, dim=1)
    gates, ups = zip(*(s.chunk(2, dim=0) for s in shards), strict=True)
    return torch.cat([*gates, *ups], dim=0)


def hf_views(key: str, shards: torch.Tensor, m: PolicyModelConfig) -> list[HFView]:
    """The HF tensors of parameter ``key`` from its TP shards stacked as ``[n, *shard]`` (n = tp for
    a sharded parameter, 1 for a replicated one), as views of ``shards`` (see ``HFView``).

    Why the views have the HF element order: for ``rows`` the shards are consecutive row ranges;
    for ``cols`` ``(H, n, c)`` is row ``i`` of every shard in turn, i.e. HF row ``i``; fused QKV
    shards are consecutive query groups, so ``[n, G/n, (q+2)d, ...]`` is ``[G, (q+2)d, ...]`` and
    q / k / v are its slices ``[:, :qd]``, ``[:, qd:qd+d]``, ``[:, qd+d:]`` (group-major, as HF
    stores heads); ``[gate_r; up_r]`` shards are ``[n, 2, F/n, H]`` and gate / up are ``[:, 0]``,
    ``[:, 1]``.
    """
    layout = hf_layout(key, m)
    rule = _tp_rule(key)
    n = shards.shape[0]
    if rule is None:
        pieces = [shards[0]]
    elif "linear_qkv" in key:
        hd, ng = _head_dim(m), m.num_query_groups
        qd = m.num_attention_heads // ng * hd
        fused = shards.reshape(ng, qd + 2 * hd, *shards.shape[2:])
        pieces = [fused[:, :qd], fused[:, qd : qd + hd], fused[:, qd + hd :]]
    elif rule == "swiglu_rows":
        halves = shards.reshape(n, 2, shards.shape[1] // 2, *shards.shape[2:])
        pieces = [halves[:, 0], halves[:, 1]]
    elif rule == "cols":
        pieces = [shards.permute(1, 0, 2)]
    else:  # rows
        pieces = [shards.reshape(-1, *shards.shape[2:])]
    out = []
    for (name, shape), view in zip(layout, pieces, strict=True):
        if view.numel() != math.prod(shape):
            raise ValueError(f"{key}: {name} has {view.numel()} elements, its HF shape {shape} needs {math.prod(shape)}")
        out.append((name, shape, view))
    return out


class TensorSource(Protocol):
    """Where shards are read from: a lazy checkpoint reader, or tensors in memory."""

    def read(self, name: str) -> torch.Tensor: ...
    def rows(self, name: str, start: int, stop: int) -> torch.Tensor: ...
    def cols(self, name: str, start: int, stop: int) -> torch.Tensor: ...


class InMemorySource:
    """A ``TensorSource`` over a dict of full HF tensors (tests; the whole-checkpoint baseline of
    ``megathunder bench load``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[name][start:stop]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[name][:, start:stop]


def read_shard(src: TensorSource, key: str, m: PolicyModelConfig, tp: int, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of Megatron parameter ``key``, reading only its ranges of the HF
    tensors (the inverse of :func:`hf_views`)."""
    layout = hf_layout(key, m)
    rule = _tp_rule(key)
    if rule is None:
        return src.read(layout[0][0])
    if rule == "cols":
        (name, (_, cols)), = layout
        c = cols // tp
        return src.cols(name, tp_rank * c, (tp_rank + 1) * c)
    if rule == "swiglu_rows":
        f = layout[0][1][0] // tp
        return torch.cat([src.rows(name, tp_rank * f, (tp_rank + 1) * f) for name, _ in layout], dim=0)
    if "linear_qkv" in key:  # query groups [g0, g1) of q, k and v, fused group by group
        ng = m.num_query_groups
        g0, g1 = tp_rank * ng // tp, (tp_rank + 1) * ng // tp
        parts = []
        for name, shape in layout:
            per_group = shape[0] // ng
            t = src.rows(name, g0 * per_group, g1 * per_group)
            parts.append(t.reshape(g1 - g0, per_group, *shape[1:]))
        return torch.cat(parts, dim=1).reshape(-1, *layout[0][1][1:])
    (name, shape), = layout  # rows: a vocabulary range
    r = shape[0] // tp
    return src.rows(name, tp_rank * r, (tp_rank + 1) * r)


def _local_to_global(name: str, offset: int, expert_offset: int = 0) -> str:
    if name.startswith("decoder.layers."):
        idx, rest = name[len("decoder.layers."):].split(".", 1)
        name = f"decoder.layers.{int(idx) + offset}.{rest}"
    e = expert_index(name)
    if e is not None and expert_offset:
        head, tail = name.split(_EXPERTS, 1)
        name = f"{head}{_EXPERTS}{e + expert_offset}.{tail.split('.', 1)[1]}"
    return name


def _expert_offset(m: PolicyModelConfig, pgs: ProcessGroups) -> int:
    """Global index of this rank's first local expert."""
    return 0 if m.num_experts is None else pgs.ep_rank * experts_per_rank(m, pgs.dims.ep)


_TE_GROUPED = re.compile(r"\.mlp\.experts\.linear_fc([12])\.weight(\d+)$")
"""TEGroupedMLP's parameters: Transformer Engine's ``GroupedLinear`` registers one weight per GEMM,
``weight0 .. weight<E_l - 1>`` (Megatron's ``TEGroupedLinear._sharded_state_dict_grouped`` reads
``weight{gemm_idx}``)."""


def _canonical(name: str) -> str:
    """TE-spec parameter name -> local-spec name (the names the mapping above uses)."""
    for local, te in _TE_NAMES.items():
        name = name.replace(te, local)
    return _TE_GROUPED.sub(lambda g: f".mlp.experts.local_experts.{g[2]}.linear_fc{g[1]}.weight", name)


def _trainable_items(model: torch.nn.Module):
    for name, param in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state") or not isinstance(param, torch.Tensor):
            continue
        yield name, param


def _legacy_grouped(model: torch.nn.Module) -> dict[str, int]:
    """Module path -> local expert count of every legacy ``GroupedMLP`` (local spec, grouped GEMM)."""
    from megatron.core.transformer.moe.experts import GroupedMLP

    return {name: mod.num_local_experts for name, mod in model.named_modules() if isinstance(mod, GroupedMLP)}


def grouped_expert_views(leaf: str, fused: torch.Tensor, num_local: int, hidden: int) -> list[torch.Tensor]:
    """Each local expert's SequentialMLP-layout tensor as a view of a legacy ``GroupedMLP``
    parameter (``leaf``: weight1 or weight2): ``fused.view(E_l, H, -1)[e].t()`` for fc1,
    ``fused.view(E_l, -1, H)[e].t()`` for fc2 (:func:`named_params` derives why)."""
    per = fused.view(num_local, hidden, -1) if leaf == "weight1" else fused.view(num_local, -1, hidden)
    return [per[e].t() for e in range(num_local)]


def named_params(model: torch.nn.Module, source: str = "param") -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical local name, tensor) of every parameter of the stage's model chunk (``source``:
    the parameter, or its gradient buffer ``main_grad``), grouped-GEMM experts one per expert.

    Megatron keeps a layer's experts in one of three modules; each holds expert ``e``'s two
    SequentialMLP tensors -- ``[gate_r; up_r]`` of shape [2F/etp, H] and the down projection's
    columns [H, F/etp], both out x in (``y = x W^T``) -- under other names:

    - TEGroupedMLP (TE spec): TE's ``GroupedLinear`` stores each GEMM's weight as ``weight<e>``,
      out x in like any TE or torch linear, and Megatron checkpoints ``weight<e>`` under
      SequentialMLP's key of expert e unchanged (``TEGroupedMLP.sharded_state_dict``, the same
      swiglu factory as a dense fc1): the same tensor, renamed (:func:`_canonical`).
    - GroupedMLP (legacy, local spec): two parameters hold every local expert, ``weight1``
      [H, E_l * 2F/etp] and ``weight2`` [E_l * F/etp, H]. Its forward reads their storage as
      ``w1 = weight1.view(E_l, H, -1)``, ``w2 = weight2.view(E_l, -1, H)`` and computes expert
      e's tokens as ``x @ w1[e]`` and ``act(.) @ w2[e]`` (``gmm(..., trans_b=False)``), the GLU
      halves being the last dim's chunks as a dense fc1's rows are. So ``w1[e]`` is expert e's
      fc1 weight transposed and ``w2[e]`` its fc2's; Megatron's own checkpoint of it writes
      ``view(E_l, ...).transpose(-1, -2)`` (``GroupedMLP.sharded_state_dict``). The views
      ``w1[e].t()`` / ``w2[e].t()`` are therefore expert e's canonical tensors, aliasing the
      fused storage: loading copies into it through them, and nothing is copied on the way out
      until a consumer reads them.

    Expert-tensor parallelism slices every expert alike in all three (rank r: gate and up rows
    r of etp, down columns r of etp), so the sharding rules above hold unchanged."""
    legacy = _legacy_grouped(model)
    for name, param in _trainable_items(model):
        value = param if source == "param" else param.main_grad
        head, _, leaf = name.rpartition(".")
        if head in legacy and leaf in ("weight1", "weight2"):
            fc = "linear_fc1" if leaf == "weight1" else "linear_fc2"
            hidden = param.shape[0] if leaf == "weight1" else param.shape[1]
            for e, view in enumerate(grouped_expert_views(leaf, value, legacy[head], hidden)):
                yield f"{head}.local_experts.{e}.{fc}.weight", view
        else:
            yield _canonical(name), value


def stage_params(model: torch.nn.Module, m: PolicyModelConfig, offset: int,
                 expert_offset: int = 0, source: str = "param") -> dict[str, torch.Tensor]:
    """Global canonical key -> this rank's parameter of the stage (the tied last-stage output layer
    included; ``expert_offset``: the global index of the rank's first local expert; ``source``:
    as :func:`named_params`)."""
    return {_local_to_global(name, offset, expert_offset): value for name, value in named_params(model, source)}


def rank_params(model: torch.nn.Module, m: PolicyModelConfig, pgs: ProcessGroups, offset: int,
                source: str = "param") -> dict[str, torch.Tensor]:
    """``stage_params`` with this rank's experts under their global indices."""
    return stage_params(model, m, offset, _expert_offset(m, pgs), source)


def _checked_params(model: torch.nn.Module, m: PolicyModelConfig, pgs: ProcessGroups, offset: int) -> dict[str, torch.Tensor]:
    params = rank_params(model, m, pgs, offset)
    keys = [k for k in megatron_keys(m, pgs.dims.pp, pgs.pp_rank) if _is_local(k, m, pgs)]
    extra = set(params) - set(keys) - {"output_layer.weight"}
    missing = set(keys) - set(params)
    if extra or missing:
        raise KeyError(f"stage {pgs.pp_rank}: parameters {sorted(extra)} have no HF mapping; "
                       f"mapped tensors {sorted(missing)} are not parameters of the model")
    return params


# ---------------------------------------------------------------------------- in


def load_hf(model: torch.nn.Module, hf_dir: str | Path, m: PolicyModelConfig, pgs: ProcessGroups, offset: int,
            src: TensorSource | None = None) -> None:
    """Copy this rank's shards of the checkpoint in ``hf_dir`` into the stage's model chunk, reading
    only those shards (``src`` replaces the lazy reader: tests and the whole-checkpoint baseline)."""
    src = src if src is not None else CheckpointReader(hf_dir)
    with torch.no_grad():
        for key, param in _checked_params(model, m, pgs, offset).items():
            value = read_shard(src, key, m, *_shard_split(key, pgs))  # tied output: the embedding's rows
            if value.shape != param.shape:
                raise ValueError(f"{key}: checkpoint shard {tuple(value.shape)} vs parameter {tuple(param.shape)}")
            param.copy_(value)
            del value


# ---------------------------------------------------------------------------- out


def stage_hf_tensors(model: torch.nn.Module, m: PolicyModelConfig, pgs: ProcessGroups, offset: int,
                     dtype: torch.dtype | None = None) -> Iterator[HFView]:
    """This stage's weights as HF tensors (``dtype``: cast first, e.g. to the inference dtype), one
    parameter at a time, yielded on the stage's (TP rank 0, DP rank 0). Every TP rank of DP rank 0
    takes part in each parameter's gather and must run the iterator to its end (it yields nothing
    there); other DP ranks (replicas) return at once -- but for an expert grid spanning DP ranks,
    whose other DP ranks of unit 0 take part in the experts' gathers."""
    if pgs.data_unit != 0:
        return
    lead = pgs.dp_rank == 0  # the unit's first DP rank: the dense gathers, and the yield
    params = _checked_params(model, m, pgs, offset)
    dtype = dtype or next(iter(params.values())).dtype
    for key in megatron_keys(m, pgs.dims.pp, pgs.pp_rank):
        if not lead and expert_index(key) is None:
            continue
        param = params.get(key)  # None: an expert of another expert-parallel rank
        stacked = gather_param(key, None if param is None else param.detach(), m, pgs, dtype)
        if pgs.tp_rank == 0 and lead:
            assert stacked is not None
            yield from hf_views(key, stacked, m)
        del stacked


def gather_param(key: str, local: torch.Tensor | None, m: PolicyModelConfig, pgs: ProcessGroups,
                 dtype: torch.dtype) -> torch.Tensor | None:
    """Parameter ``key``'s shards (``local``: this rank's, None where it holds none) stacked as
    ``[n, *shard]`` and cast to ``dtype`` on TP rank 0 (None on other TP ranks; a replicated
    parameter is TP rank 0's own, n = 1). An expert's shards come from the TP ranks that hold it:
    expert-tensor slices e = 0 .. etp - 1 of its expert-parallel rank (``ProcessGroups.expert_tp_rank``),
    point to point as :func:`gather_shards` does."""
    e = expert_index(key)
    if e is None:
        if pgs.dims.tp > 1 and _tp_rule(key) is not None:
            assert local is not None
            return gather_shards(local, pgs, dtype)
        return None if pgs.tp_rank != 0 or local is None else local.to(dtype)[None]
    owner, n = e // experts_per_rank(m, pgs.dims.ep), pgs.dims.etp
    holders = [pgs.expert_tp_rank(owner, s) for s in range(n)]  # ranks of the expert grid
    # the grid is the TP group, or (EP across DP ranks) Megatron's tp_ep group, unit 0's
    group, me = (pgs.tp, pgs.tp_rank) if pgs.dims.expert_span == 1 else (pgs.collection.tp_ep, pgs.expert_grid_rank)
    if me != 0:
        if me in holders:
            assert local is not None
            dist.send(local.to(dtype).contiguous(), dst=dist.get_global_rank(group, 0), group=group)
        return None
    if holders == [0]:
        assert local is not None
        return local.to(dtype)[None]
    stacked = torch.empty((n, *_expert_shard_shape(key, m, n)), dtype=dtype, device=pgs.device)
    works = [dist.irecv(stacked[s], src=dist.get_global_rank(group, r), group=group)
             for s, r in enumerate(holders) if r != 0]
    if 0 in holders:
        assert local is not None
        stacked[holders.index(0)].copy_(local)
    for work in works:
        work.wait()
    return stacked


def _expert_shard_shape(key: str, m: PolicyModelConfig, n: int) -> tuple[int, ...]:
    """One of ``n`` expert-tensor-parallel shards of expert parameter ``key``."""
    fe, h = m.expert_ffn_hidden_size, m.hidden_size
    return (2 * fe // n, h) if key.endswith("linear_fc1.weight") else (h, fe // n)


def gather_shards(local: torch.Tensor, pgs: ProcessGroups, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Every TP rank's ``local`` (cast to ``dtype``) stacked as ``[tp, *local.shape]`` on TP rank 0,
    None elsewhere. Point-to-point into the stacked buffer's rows: ``dist.gather`` on gloo stages
    the whole result in a second buffer first, and an all-gather would put it on every rank."""
    dtype = dtype or local.dtype
    if pgs.tp_rank != 0:
        dist.send(local.to(dtype).contiguous(), dst=dist.get_global_rank(pgs.tp, 0), group=pgs.tp)
        return None
    stacked = torch.empty((pgs.dims.tp, *local.shape), dtype=dtype, device=local.device)
    works = [dist.irecv(stacked[r], src=dist.get_global_rank(pgs.tp, r), group=pgs.tp) for r in range(1, pgs.dims.tp)]
    stacked[0].copy_(local)  # cast on the way in
    for work in works:
        work.wait()
    return stacked


def shard_file_name(pp: int, pp_rank: int) -> str:
    return "model.safetensors" if pp == 1 else f"model-{pp_rank + 1:05d}-of-{pp:05d}.safetensors"


def hf_config_dict(m: PolicyModelConfig, dtype: str) -> dict:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "mixtral": "MixtralForCausalLM"}[m.family]
    moe: dict = {}
    if m.family in ("qwen3_moe", "qwen2_moe"):
        moe = {"num_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk,
               "moe_intermediate_size": m.expert_ffn_hidden_size, "norm_topk_prob": m.moe_norm_topk_prob,
               "decoder_sparse_step": 1, "mlp_only_layers": []}
    if m.family == "qwen2_moe":
        moe.update(shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size, qkv_bias=True,
                   use_sliding_window=False)
    elif m.family == "mixtral":  # its intermediate_size is the experts' width
        moe = {"num_local_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk,
               "sliding_window": None}
    return {**moe,
        "architectures": [arch],
        "model_type": m.family,
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.expert_ffn_hidden_size if m.family == "mixtral" else m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": _head_dim(m),
        "max_position_embeddings": m.max_position_embeddings,
        "rope_theta": m.rope_theta,
        "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": dtype,
    }


def export_hf(
    model: torch.nn.Module, out_dir: str | Path, m: PolicyModelConfig, pgs: ProcessGroups, offset: int,
    source_dir: str | Path | None = None, dtype: str = "float32",
) -> None:
    """A Hugging Face directory, written while streaming: each pipeline stage's (TP 0, DP 0) rank
    writes its stage's file tensor by tensor (``model.safetensors`` with one stage, else
    ``model-0000s-of-0000P.safetensors`` + ``model.safetensors.index.json``); rank 0 writes
    ``config.json`` (or copies tokenizer and config files from ``source_dir``). Every rank calls
    it; ``out_dir`` must be one directory for all of them (one machine or a shared file system).
    Returns once every file is complete."""
    out = Path(out_dir)
    pp, stage = pgs.dims.pp, pgs.pp_rank
    params_dtype = next(iter(stage_params(model, m, offset).values())).dtype
    if pgs.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for old in [*out.glob("*.safetensors"), out / INDEX_NAME]:  # an earlier export's shards
            old.unlink(missing_ok=True)
    _barrier(pgs)
    writer = None
    if pgs.tp_rank == 0 and pgs.dp_rank == 0:
        layout = [(name, shape, params_dtype) for name, shape in hf_stage_layout(m, pp, stage)]
        writer = StreamingWriter(out / shard_file_name(pp, stage), layout)
    try:
        for name, shape, view in stage_hf_tensors(model, m, pgs, offset):
            assert writer is not None
            writer.write(name, view.reshape(shape))
    finally:
        if writer is not None:
            writer.close()
    if pgs.rank == 0:
        if pp > 1:
            weight_map = {name: shard_file_name(pp, s) for s in range(pp) for name, _ in hf_stage_layout(m, pp, s)}
            total = sum(math.prod(shape) * params_dtype.itemsize for s in range(pp)
                        for _, shape in hf_stage_layout(m, pp, s))
            write_index(out, weight_map, total)
        if source_dir is not None:
            for f in Path(source_dir).iterdir():
                if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX_NAME:
                    shutil.copy2(f, out / f.name)
        else:
            (out / "config.json").write_text(json.dumps(hf_config_dict(m, dtype), indent=2) + "\n")
    _barrier(pgs)


def _barrier(pgs: ProcessGroups) -> None:
    if pgs.world_size > 1:
        dist.barrier()


# ---------------------------------------------------------------------------- tests' helpers


def gather_full_state(
    model: torch.nn.Module, m: PolicyModelConfig, pgs: ProcessGroups, offset: int,
    source: str = "param",
) -> dict[str, torch.Tensor] | None:
    """The full Megatron state dict on global rank 0 (None elsewhere): TP all-gather, PP gather.
    For tests that compare whole models across layouts -- it holds the model on rank 0.

    ``source="main_grad"`` gathers the parameters' gradient buffers instead (after a data-parallel
    all-reduce they hold the full reduced gradient on every rank).
    """
    stage: dict[str, torch.Tensor] = {}
    for canon, tensor in named_params(model, source):
        if (canon == "output_layer.weight" and m.tie_word_embeddings) or expert_index(canon) is not None:
            continue
        local = tensor.detach()
        if pgs.dims.tp > 1 and _tp_rule(canon) is not None:
            parts = [torch.empty_like(local) for _ in range(pgs.dims.tp)]
            dist.all_gather(parts, local.contiguous(), group=pgs.tp)
            full = unshard(canon, parts)
        else:
            full = local
        stage[_local_to_global(canon, offset)] = full.cpu().clone()
    if m.num_experts is not None and pgs.data_unit == 0:  # experts: onto grid rank 0 from their holders
        mine = {k: p.detach() for k, p in rank_params(model, m, pgs, offset, source).items()
                if expert_index(k) is not None}
        dtype = next(iter(mine.values())).dtype
        for key in megatron_keys(m, pgs.dims.pp, pgs.pp_rank):
            if expert_index(key) is None:
                continue
            stacked = gather_param(key, mine.get(key), m, pgs, dtype)
            if stacked is not None:
                stage[key] = unshard(key, list(stacked)).cpu().clone()
    if pgs.dims.pp == 1:
        return stage if pgs.rank == 0 else None
    gathered: list[dict | None] = [None] * pgs.dims.pp
    if pgs.tp_rank == 0 and pgs.dp_rank == 0:
        dist.gather_object(stage, gathered if pgs.pp_rank == 0 else None, dst=dist.get_global_rank(pgs.pp, 0),
                           group=pgs.pp)
    if pgs.rank != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part or {})
    return merged


def load_full_state(
    model: torch.nn.Module, full: dict[str, torch.Tensor], m: PolicyModelConfig, pgs: ProcessGroups, offset: int
) -> None:
    """Copy this rank's shard of a full Megatron state dict into the stage's model chunk (tests)."""
    with torch.no_grad():
        for canon, param in named_params(model):
            key = _local_to_global(canon, offset, _expert_offset(m, pgs))
            if canon == "output_layer.weight" and m.tie_word_embeddings:
                key = "embedding.word_embeddings.weight"  # last stage's copy of the tied embedding
            if key not in full:
                raise KeyError(f"checkpoint has no tensor for {key} (parameter {canon})")
            param.copy_(shard(key, full[key], *_shard_split(key, pgs)).to(param.dtype))
