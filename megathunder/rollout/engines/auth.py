"""A shared secret for rollout servers that are reachable beyond loopback.

vLLM's ``--api-key`` (or ``VLLM_API_KEY``) guards only ``/v1``, ``/v2``, ``/inference`` and
``/cohere``; the development endpoints megathunder uses for weight sync (``/pause``,
``/collective_rpc``, ``/reset_prefix_cache``, ``/update_weight_version``, ``/resume``) stay open,
and ``/collective_rpc`` calls any worker method by name. So a server that gets a key also gets
:class:`BearerAuthMiddleware` (vLLM's ``--middleware`` flag): every path but ``/health`` needs
``Authorization: Bearer <key>``.

The key never travels on a command line (``ps`` shows those) or in a config file: the config
names an environment variable (``EngineConfig.api_key_env``), the launcher passes its value to
the server as ``VLLM_API_KEY`` and the client sends it as a Bearer token.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from megathunder.config.base import is_loopback

MIDDLEWARE = f"{__name__}.BearerAuthMiddleware"
OPEN_PATHS = ("/health",)  # liveness probes carry no secret


def read_api_key(env_name: str | None, field: str = "rollout.engine.api_key_env") -> str | None:
    """The secret held in ``env_name`` (None when no variable is configured); a configured but
    unset or empty variable is an error that names it (and the config ``field``), never a silent
    unauthenticated server."""
    if env_name is None:
        return None
    key = os.environ.get(env_name, "")
    if not key:
        raise RuntimeError(
            f"{field}: environment variable {env_name} is not set or empty; "
            "export the shared secret there"
        )
    return key


def bearer_matches(header: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <key>`` (compared in constant time)."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token), _digest(key))


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class BearerAuthMiddleware:
    """ASGI middleware: 401 unless the request carries ``Authorization: Bearer $VLLM_API_KEY``.

    Built by vLLM with no arguments, so it reads the key from the environment; without one it
    refuses to build (the server fails to start rather than serve unguarded)."""

    def __init__(self, app, api_key: str | None = None) -> None:
        key = api_key or os.environ.get("VLLM_API_KEY", "")
        if not key:
            raise RuntimeError("BearerAuthMiddleware: VLLM_API_KEY is not set")
        self.app = app
        self._key_digest = _digest(key)

    def _authorised(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    _digest(token), self._key_digest
                )
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self._authorised(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = b'{"error": "Unauthorized"}'
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())],
            }
        )  # fmt: skip
        await send({"type": "http.response.body", "body": body})
