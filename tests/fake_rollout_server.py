"""A stand-in for a vLLM server on loopback: the endpoints ServerEngine uses, answering after a
fixed delay with tokens derived from the prompt. Run as a process so a test can kill it.

    python -m tests.fake_rollout_server PORT DELAY_S
    FAKE_API_KEY (or VLLM_API_KEY): require this Bearer token on every path but /health
    FAKE_DROP_FIRST=N: close the connection of the first N generate requests, without an answer
"""

from __future__ import annotations

import asyncio
import os
import sys

from aiohttp import web


def main() -> None:
    port, delay = int(sys.argv[1]), float(sys.argv[2])
    key = os.environ.get("FAKE_API_KEY") or os.environ.get("VLLM_API_KEY")
    served = {"n": 0}

    @web.middleware
    async def auth(request, handler):
        if key and request.path != "/health" and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    drop_first = int(os.environ.get("FAKE_DROP_FIRST", "0"))

    async def generate(request):
        body = await request.json()
        if served.setdefault("dropped", 0) < drop_first:  # drop the connection, stay alive
            served["dropped"] += 1
            request.transport.close()
            await asyncio.sleep(3600)
        await asyncio.sleep(delay)
        n = body["sampling_params"]["max_tokens"]
        ids = [(sum(body["token_ids"]) + k) % 97 for k in range(n)]
        served["n"] += 1
        return web.json_response({
            "port": port,
            "choices": [{
                "token_ids": ids,
                "logprobs": {"content": [{"token_id": t, "logprob": -0.01 * (t + 1)} for t in ids]},
                "finish_reason": "length",
                "weight_versions": [{"version": "0", "start": 0, "end": n}],
            }],
        })

    async def ok(request):
        return web.json_response({"success": True})

    async def health(request):
        return web.Response(text="")

    app = web.Application(middlewares=[auth])
    app.router.add_post("/inference/v1/generate", generate)
    for path in ("/update_weight_version", "/pause", "/resume", "/collective_rpc", "/reset_prefix_cache"):
        app.router.add_post(path, ok)
    app.router.add_get("/health", health)
    print(f"listening {port}", flush=True)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=True)


if __name__ == "__main__":
    main()
