"""Hugging Face checkpoints (safetensors + config.json) in and out of the sharded Megatron policy.

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

Conversion is slicing and concatenation only, so import followed by export is bit-exact.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megathunder.config import ConfigError, PolicyModelConfig
from megathunder.learner.parallel import ProcessGroups

_TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def read_safetensors_dir(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"learner.model.hf_checkpoint: no *.safetensors files in {hf_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _head_dim(m: PolicyModelConfig) -> int:
    return m.head_dim or m.hidden_size // m.num_attention_heads


def hf_to_megatron(hf: dict[str, torch.Tensor], m: PolicyModelConfig) -> dict[str, torch.Tensor]:
    """Full (unsharded) Megatron state dict with global layer indices."""
    hd, ng = _head_dim(m), m.num_query_groups
    q_per_group = m.num_attention_heads // ng
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not m.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(m.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = src + "self_attn."
        for suffix in ("weight", "bias") if m.family == "qwen2" else ("weight",):
            q = hf[attn + f"q_proj.{suffix}"].reshape(ng, q_per_group * hd, -1)
            k = hf[attn + f"k_proj.{suffix}"].reshape(ng, hd, -1)
            v = hf[attn + f"v_proj.{suffix}"].reshape(ng, hd, -1)
            fused = torch.cat([q, k, v], dim=1)
            out[dst + f"self_attention.linear_qkv.{suffix}"] = (
                fused.reshape(-1, m.hidden_size) if suffix == "weight" else fused.reshape(-1)
            )
        if m.family == "qwen3":
            out[dst + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"]
            out[dst + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"]
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]], dim=0
        )
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
    return out


def megatron_to_hf(full: dict[str, torch.Tensor], m: PolicyModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of ``hf_to_megatron``."""
    hd, ng = _head_dim(m), m.num_query_groups
    q_per_group = m.num_attention_heads // ng
    out = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"],
           "model.norm.weight": full["decoder.final_layernorm.weight"]}
    if not m.tie_word_embeddings:
        out["lm_head.weight"] = full["output_layer.weight"]
    for i in range(m.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = dst + "self_attn."
        for suffix in ("weight", "bias") if m.family == "qwen2" else ("weight",):
            fused = full[src + f"self_attention.linear_qkv.{suffix}"].reshape(ng, (q_per_group + 2) * hd, -1)
            q, k, v = fused.split([q_per_group * hd, hd, hd], dim=1)
            for name, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                t = t.reshape(-1, m.hidden_size) if suffix == "weight" else t.reshape(-1)
                out[attn + f"{name}.{suffix}"] = t.contiguous()
        if m.family == "qwen3":
            out[attn + "q_norm.weight"] = full[src + "self_attention.q_layernorm.weight"]
            out[attn + "k_norm.weight"] = full[src + "self_attention.k_layernorm.weight"]
        out[dst + "input_layernorm.weight"] = full[src + "input_layernorm.weight"]
        out[attn + "o_proj.weight"] = full[src + "self_attention.linear_proj.weight"]
        out[dst + "post_attention_layernorm.weight"] = full[src + "pre_mlp_layernorm.weight"]
        gate, up = full[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[dst + "mlp.gate_proj.weight"] = gate.contiguous()
        out[dst + "mlp.up_proj.weight"] = up.contiguous()
        out[dst + "mlp.down_proj.weight"] = full[src + "mlp.linear_fc2.weight"]
    return out


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


def _local_to_global(name: str, offset: int) -> str:
    if name.startswith("decoder.layers."):
        idx, rest = name[len("decoder.layers."):].split(".", 1)
        return f"decoder.layers.{int(idx) + offset}.{rest}"
    return name


def _canonical(name: str) -> str:
    """TE-spec parameter name -> local-spec name (the names the mapping above uses)."""
    for local, te in _TE_NAMES.items():
        name = name.replace(te, local)
    return name


def _trainable_items(model: torch.nn.Module):
    for name, param in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state") or not isinstance(param, torch.Tensor):
            continue
        yield name, param


def load_full_state(
    model: torch.nn.Module, full: dict[str, torch.Tensor], m: PolicyModelConfig, pgs: ProcessGroups, offset: int
) -> None:
    """Copy this rank's shard of a full Megatron state dict into the stage's model chunk."""
    with torch.no_grad():
        for name, param in _trainable_items(model):
            canon = _canonical(name)
            key = _local_to_global(canon, offset)
            if canon == "output_layer.weight" and m.tie_word_embeddings:
                key = "embedding.word_embeddings.weight"  # last stage's copy of the tied embedding
            if key not in full:
                raise KeyError(f"checkpoint has no tensor for {key} (parameter {name})")
            value = shard(key, full[key], pgs.dims.tp, pgs.tp_rank)
            if value.shape != param.shape:
                raise ValueError(f"{key}: checkpoint shard {tuple(value.shape)} vs parameter {tuple(param.shape)}")
            param.copy_(value.to(param.dtype))


def gather_full_state(
    model: torch.nn.Module, m: PolicyModelConfig, pgs: ProcessGroups, offset: int,
    source: str = "param",
) -> dict[str, torch.Tensor] | None:
    """The full Megatron state dict on global rank 0 (None elsewhere): TP all-gather, PP gather.

    ``source="main_grad"`` gathers the parameters' gradient buffers instead (after a data-parallel
    all-reduce they hold the full reduced gradient on every rank).
    """
    stage: dict[str, torch.Tensor] = {}
    tp_group = pgs.tp
    for name, param in _trainable_items(model):
        canon = _canonical(name)
        if canon == "output_layer.weight" and m.tie_word_embeddings:
            continue
        local = param.detach() if source == "param" else param.main_grad.detach()
        if pgs.dims.tp > 1 and _tp_rule(canon) is not None:
            parts = [torch.empty_like(local) for _ in range(pgs.dims.tp)]
            dist.all_gather(parts, local.contiguous(), group=tp_group)
            full = unshard(canon, parts)
        else:
            full = local
        stage[_local_to_global(canon, offset)] = full.cpu().clone()
    if pgs.dims.pp == 1:
        return stage if pgs.rank == 0 else None
    gathered: list[dict | None] = [None] * pgs.dims.pp
    if pgs.tp_rank == 0 and pgs.dp_rank == 0:
        dist.gather_object(stage, gathered if pgs.pp_rank == 0 else None, dst=_pp_first_rank(pgs), group=pgs.pp)
    if pgs.rank != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part or {})
    return merged


def _pp_first_rank(pgs: ProcessGroups) -> int:
    return dist.get_global_rank(pgs.pp, 0)


def import_hf(model: torch.nn.Module, hf_dir: str | Path, m: PolicyModelConfig, pgs: ProcessGroups, offset: int) -> None:
    load_full_state(model, hf_to_megatron(read_safetensors_dir(hf_dir), m), m, pgs, offset)


def hf_config_dict(m: PolicyModelConfig, dtype: str) -> dict:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[m.family]
    return {
        "architectures": [arch],
        "model_type": m.family,
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
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
    """Write ``model.safetensors`` + ``config.json`` (tokenizer files copied from ``source_dir``)."""
    from safetensors.torch import save_file

    full = gather_full_state(model, m, pgs, offset)
    if full is None:
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in megatron_to_hf(full, m).items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    if source_dir is not None:
        for f in Path(source_dir).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, out / f.name)
    else:
        (out / "config.json").write_text(json.dumps(hf_config_dict(m, dtype), indent=2) + "\n")
