"""``megathunder serve``: one vLLM server for a config's model, as a rollout node runs it.

The command line is :func:`~megathunder.rollout.engines.server.server_command` (the one
``ServerPool`` uses locally), with ``VLLM_SERVER_DEV_MODE=1`` for the weight-update endpoints;
this process ``exec``s it, so srun's signals and exit status are vLLM's own. The trainer attaches
with ``rollout.engine.deployment=server rollout.engine.server_urls=[...]`` and pushes its weights
before the first sample, so the server only needs the policy's architecture and tokenizer:

    learner.model.hf_checkpoint set   -> that directory
    run.init_model=tiny               -> a tiny Qwen2 built here (``<output_dir>/rollout_models/``)
    run.init_model=PATH               -> PATH
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from megathunder.config import Config


class ServeError(RuntimeError):
    """The server cannot be started as asked (no model at the path, bad arguments)."""


def serve_model_dir(cfg: Config, model: str | None, port: int) -> Path:
    if model is None:
        model = cfg.learner.model.hf_checkpoint
    if model is None and cfg.run.init_model == "tiny":
        from megathunder.models.tiny_hf import save_tiny_qwen2

        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        path = Path(cfg.run.output_dir) / "rollout_models" / f"{node}-{port}"  # one per server: no races
        if not (path / "model.safetensors").is_file():
            save_tiny_qwen2(path)
        return path
    path = Path(model if model is not None else cfg.run.init_model)
    if not (path / "config.json").is_file():
        raise ServeError(f"rollout server: model {path} has no config.json")
    return path


def serve_command(cfg: Config, port: int, host: str, model: str | None = None,
                  tensor_parallel: int = 1) -> list[str]:
    from megathunder.rollout.engines.server import server_command

    engine = cfg.rollout.engine.model_copy(deep=True)
    engine.host = host
    if tensor_parallel > 1:
        engine.vllm_kwargs = {**engine.vllm_kwargs, "tensor_parallel_size": tensor_parallel}
    return server_command(str(serve_model_dir(cfg, model, port)), engine, port)


def serve_env(cfg: Config, host: str) -> dict[str, str]:
    """The server's environment: the weight-update endpoints on, and the shared secret of
    ``rollout.engine.api_key_env`` as VLLM_API_KEY (required off loopback, as the config requires)."""
    from megathunder.rollout.engines.auth import is_loopback, read_api_key

    try:
        key = read_api_key(cfg.rollout.engine.api_key_env)
    except RuntimeError as err:
        raise ServeError(f"rollout server: {err}") from None
    if key is None and not is_loopback(host):
        raise ServeError(f"rollout server: binding to {host} (not loopback) needs rollout.engine.api_key_env "
                         "(the endpoints that load weights would be open to the network)")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if cfg.rollout.engine.batch_invariant:
        env["VLLM_BATCH_INVARIANT"] = "1"
    if key is not None:
        env["VLLM_API_KEY"] = key
    return env


def serve(cfg: Config, port: int, host: str, model: str | None = None, tensor_parallel: int = 1) -> int:
    try:
        env = serve_env(cfg, host)
        cmd = serve_command(cfg, port, host, model, tensor_parallel)
    except ServeError as err:
        print(f"megathunder serve: {err}", file=sys.stderr, flush=True)
        return 2
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(f"megathunder serve: vLLM server on {node} at http://{host}:{port} (model {cmd[cmd.index('--model') + 1]}, "
          f"tensor parallel {tensor_parallel})", file=sys.stderr, flush=True)
    os.execve(cmd[0], cmd, env)
    return 0  # not reached
