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


def serve(cfg: Config, port: int, host: str, model: str | None = None, tensor_parallel: int = 1) -> int:
    try:
        cmd = serve_command(cfg, port, host, model, tensor_parallel)
    except ServeError as err:
        print(f"megathunder serve: {err}", file=sys.stderr, flush=True)
        return 2
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(f"megathunder serve: vLLM server on {node} at http://{host}:{port} (model {cmd[cmd.index('--model') + 1]}, "
          f"tensor parallel {tensor_parallel})", file=sys.stderr, flush=True)
    os.execve(cmd[0], cmd, dict(os.environ, VLLM_SERVER_DEV_MODE="1"))
    return 0  # not reached
