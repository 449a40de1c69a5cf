"""The tiny random Qwen2 checkpoint: loads with transformers, tokenizer and chat template behave."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from megathunder.models.tiny_hf import SPECIAL_TOKENS, TOOL_TOKENS, save_tiny_qwen2  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_tiny_qwen2(tmp_path_factory.mktemp("tiny"))
    return path, AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)


def test_checkpoint_files_and_model(checkpoint):
    path, tok, model = checkpoint
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in path.iterdir()
    }
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["vocab_size"] >= len(tok)
    assert config["hidden_size"] // config["num_attention_heads"] >= 32  # vLLM CPU attention
    assert model.dtype == torch.float32
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, config["vocab_size"]) and torch.isfinite(logits).all()


def test_same_seed_same_checkpoint(tmp_path):
    from safetensors.torch import load_file

    a = load_file(save_tiny_qwen2(tmp_path / "a") / "model.safetensors")
    b = load_file(save_tiny_qwen2(tmp_path / "b") / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tags_are_single_tokens(checkpoint):
    _, tok, _ = checkpoint
    for tag in SPECIAL_TOKENS + TOOL_TOKENS:
        ids = tok(f"x{tag}y", add_special_tokens=False)["input_ids"]
        assert tok.convert_tokens_to_ids(tag) in ids, tag
    assert tok.eos_token == "<|im_end|>"
    text = "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>"
    decoded = tok.decode(tok(text)["input_ids"], skip_special_tokens=True)
    assert decoded == "assistant\n<tool_call>\n{}\n</tool_call>"  # tool tags survive for parsers


def test_chat_template_with_tools(checkpoint):
    _, tok, _ = checkpoint
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expr": "2+3"}}}],
        },
        {"role": "tool", "content": "5"},
    ]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "calculator", "parameters": {}}}\n</tools>' in text
    assert (
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expr": "2+3"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=False)
    assert plain == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"


def test_tiny_moe_checkpoint_is_a_qwen3_moe_with_one_tensor_per_expert(tmp_path):
    """``num_experts > 0``: a Qwen3-MoE saved as the published checkpoints are (one tensor per
    expert), loading back into transformers unchanged; the router really routes (random weights,
    several experts chosen over a sequence) and no top-k choice is near a tie."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from megathunder.models.tiny_hf import TinyModelSpec

    spec = TinyModelSpec(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, hidden_size=64,
                         num_heads=2, num_kv_heads=1)
    path = save_tiny_qwen2(tmp_path / "moe", spec)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["norm_topk_prob"] is True
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for e in range(4):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.0.mlp.experts.{e}.{proj}.weight" in names
    assert "model.layers.1.mlp.gate.weight" in names
    model = AutoModelForCausalLM.from_pretrained(path)
    routed = []
    model.model.layers[0].mlp.gate.register_forward_hook(lambda m, i, o: routed.append(o))
    with torch.no_grad():
        logits = model(torch.arange(1, 33)[None]).logits
    assert torch.isfinite(logits).all()
    router_logits, _, chosen = routed[0]
    assert len(chosen.unique()) == 4
    top = router_logits.sort(dim=-1, descending=True).values
    assert (top[:, 1] - top[:, 2]).abs().min() > 1e-4  # the 2nd and 3rd choices are far from a tie
