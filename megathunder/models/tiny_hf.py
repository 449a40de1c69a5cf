"""A tiny random Qwen2 (or Qwen3-MoE) model and a locally trained tokenizer, saved with ``transformers``.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained with ``tokenizers`` on
a corpus generated in this module, and the model is a randomly initialised ``Qwen2ForCausalLM``.
The directory it writes is a regular Hugging Face checkpoint (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` with a chat template), so
vLLM, transformers and the learner's HF import load it exactly as they load a real Qwen2.
With ``TinyModelSpec.num_experts > 0`` the model is a ``Qwen3MoeForCausalLM`` instead (q/k RMSNorm,
every layer a sparse MoE block: a softmax top-k router, ``norm_topk_prob``, no shared expert), saved
with one tensor per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``) as Qwen3-30B-A3B's
checkpoint is: the mixture-of-experts student of the tests and the MoE quickstart.

The chat template follows Qwen2.5's layout: ``<|im_start|>role\\n...<|im_end|>`` turns, tools
listed in the system turn inside ``<tools></tools>``, and Hermes-style tool calls
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``; tool results come back as a user turn
wrapped in ``<tool_response></tool_response>``. Each of these tags is one token. The
``<|...|>`` markers are special (dropped by ``skip_special_tokens``); the tool tags are added
tokens that are never split but are kept when decoding, as in Qwen2.5, so a tool-call parser sees
them in decoded text.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from megathunder.models.local_tokenizer import train_byte_level_bpe

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Written for this project (not copied): Qwen2.5's turn layout with Hermes tool tags.
# Jinja with every newline written as '\n' inside an expression, because transformers renders
# templates with trim_blocks (a newline right after a block tag is dropped).
_TOOLS_PREAMBLE = (
    r"\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    r"You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FORMAT = (
    r"\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    r"within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    r"{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
)
CHAT_TEMPLATE = (
    "{% if tools %}"
    r"{{ '<|im_start|>system\n' }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}"
    "{% else %}You are a helpful assistant.{% endif %}"
    "{{ '" + _TOOLS_PREAMBLE + "' }}"
    r"{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '" + _TOOLS_FORMAT + "' }}"
    "{% elif messages[0].role == 'system' %}"
    r"{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}"
    "{% endif %}"
    r"{{ '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    r"{{ '<|im_end|>\n' }}{% endif %}"
    "{% elif message.role != 'system' or not loop.first %}"
    r"{{ '<|im_start|>' + message.role + '\n' + (message.content or '') }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    r"{% if message.content or not loop.first %}{{ '\n' }}{% endif %}"
    r"""{{ '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}"""
    "{{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}"
    r"{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    r"{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the random model. Defaults give 0.44M parameters: fast on one CPU core.

    head_dim = hidden_size / num_heads: vLLM's CPU attention rejects 16; 32 works.
    """

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 512  # BPE target; the model's vocabulary is rounded up to a multiple of 64
    model_vocab_size: int | None = None
    """The model's vocabulary when larger than the tokenizer's (ids the tokenizer never produces),
    e.g. 49152 for a model of SmolLM2's shape; null: the tokenizer's, rounded up to 64."""
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    init_std: float = 0.2
    """Larger than HF's 0.02 so that outputs depend visibly on context (logits far from flat):
    tests comparing engines need distributions that differ when the KV cache is wrong."""
    seed: int = 0
    num_experts: int = 0
    """0: a dense Qwen2; > 0: a Qwen3-MoE with this many routed experts per layer."""
    num_experts_per_tok: int = 2
    """MoE: experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 64
    """MoE: each expert's SwiGLU width."""
    norm_topk_prob: bool = True
    """MoE: renormalise the top-k routing probabilities to sum to 1 (Qwen3-30B-A3B does)."""


def _corpus(rng: random.Random, num_lines: int = 3000) -> Iterator[str]:
    """Text resembling what the bundled tasks produce: arithmetic, chat, tool calls, code, shell."""
    words = (
        "the a of to and in is it that for on with as you are this be at or by from an not "
        "answer question compute sum product file test run edit read write error result value "
        "def return import print if else for while class self assert true false none list"
    ).split()
    tools = ("calculator", "read_file", "write_file", "run", "bash", "edit")
    for i in range(num_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        kind = i % 6
        if kind == 0:
            yield f"What is {a} + {b}? The answer is {a + b}."
        elif kind == 1:
            yield f"{a} * {b} = {a * b}; {a} - {b} = {a - b}"
        elif kind == 2:
            yield " ".join(rng.choice(words) for _ in range(rng.randint(5, 20)))
        elif kind == 3:
            name = rng.choice(tools)
            yield json.dumps({"name": name, "arguments": {"x": a, "path": f"src/m{b}.py"}})
        elif kind == 4:
            yield f"def f{a}(x):\n    return x * {b}\n\nassert f{a}(2) == {2 * b}\n"
        else:
            yield f"$ ls -la\n$ cat src/m{a}.py\n$ python -m pytest -q tests/test_{b}.py\n"


def build_tokenizer(vocab_size: int = 512, seed: int = 0):
    """Byte-level BPE trained on the generated corpus, wrapped as a transformers fast tokenizer."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tok = train_byte_level_bpe(_corpus(random.Random(seed)), vocab_size, SPECIAL_TOKENS)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def build_model(spec: TinyModelSpec, vocab_size: int, eos_token_id: int, pad_token_id: int):
    """A randomly initialised fp32 Qwen2ForCausalLM (q/k/v biases as in Qwen2; untied embeddings
    unless the spec ties them), or a Qwen3MoeForCausalLM when ``spec.num_experts > 0``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if spec.num_experts > 0:
        return build_moe_model(spec, vocab_size, eos_token_id, pad_token_id)
    config = Qwen2Config(**_shared_config(spec, vocab_size, eos_token_id, pad_token_id))
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # HF zero-initialises biases; random ones exercise the bias mapping
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, spec.init_std)
    return model.eval()


def _shared_config(spec: TinyModelSpec, vocab_size: int, eos_token_id: int, pad_token_id: int) -> dict:
    """The config fields the dense and the MoE tiny models share."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        torch_dtype="float32",
    )


def build_moe_model(spec: TinyModelSpec, vocab_size: int, eos_token_id: int, pad_token_id: int):
    """A randomly initialised fp32 Qwen3MoeForCausalLM of the spec's sizes (every layer sparse).

    The router's weights are drawn like every other matrix (std ``init_std``; transformers starts
    them at zero), so tokens really are routed to different experts and no two experts' router
    logits tie (ties would make the top-k choice depend on summation order)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if not 0 < spec.num_experts_per_tok <= spec.num_experts:
        raise ValueError(f"num_experts_per_tok {spec.num_experts_per_tok} must be in 1..num_experts={spec.num_experts}")
    config = Qwen3MoeConfig(
        **_shared_config(spec, vocab_size, eos_token_id, pad_token_id),
        moe_intermediate_size=spec.moe_intermediate_size,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=spec.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        head_dim=spec.hidden_size // spec.num_heads,
    )
    torch.manual_seed(spec.seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, spec.init_std)
            layer.mlp.experts.gate_up_proj.normal_(0.0, spec.init_std)
            layer.mlp.experts.down_proj.normal_(0.0, spec.init_std)
    return model.eval()


def save_tiny_qwen2(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write tokenizer + random model to ``out_dir`` (created if needed) and return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size, spec.seed)
    vocab_size = -(-len(tokenizer) // 64) * 64
    if spec.model_vocab_size is not None:
        if spec.model_vocab_size < vocab_size:
            raise ValueError(f"model_vocab_size {spec.model_vocab_size} is below the tokenizer's {vocab_size}")
        vocab_size = spec.model_vocab_size
    model = build_model(
        spec,
        vocab_size,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    model.generation_config.eos_token_id = [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--hidden-size", type=int, default=TinyModelSpec.hidden_size)
    parser.add_argument("--num-layers", type=int, default=TinyModelSpec.num_layers)
    parser.add_argument("--seed", type=int, default=TinyModelSpec.seed)
    parser.add_argument("--num-experts", type=int, default=0, help="> 0: a Qwen3-MoE with this many experts")
    parser.add_argument("--num-experts-per-tok", type=int, default=TinyModelSpec.num_experts_per_tok)
    args = parser.parse_args(argv)
    spec = TinyModelSpec(hidden_size=args.hidden_size, num_layers=args.num_layers, seed=args.seed,
                         num_experts=args.num_experts, num_experts_per_tok=args.num_experts_per_tok)
    print(save_tiny_qwen2(args.out_dir, spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
