"""Sandboxes that run an episode's tool calls: a local one (namespaces) and containers.

``build_sandbox(cfg, image)`` returns a ready sandbox for one episode; close it when done. A task
instance that brings its own environment (a Terminal-Bench / Harbor task directory's Dockerfile)
passes it as ``dockerfile`` and ``context``: a docker or podman backend builds ``image`` from it
once per process (episodes of the same task wait for the one build) unless the image exists.
"""

from __future__ import annotations

import asyncio

from megathunder.config import LocalSandboxConfig, SandboxConfig
from megathunder.rollout.sandbox import images
from megathunder.rollout.sandbox.container import ContainerSandbox
from megathunder.rollout.sandbox.core import ExecResult, Sandbox, SandboxError
from megathunder.rollout.sandbox.local import LocalSandbox


_builds: dict[tuple[int, str], asyncio.Lock] = {}  # (event loop, image): one build at a time


async def build_sandbox(cfg: SandboxConfig, image: str | None = None, *, dockerfile: str | None = None,
                        context: str | None = None) -> Sandbox:
    """A sandbox of the ``sandbox`` section's backend; ``image``: the task instance's container
    image (else ``sandbox.image``), built from ``dockerfile`` in ``context`` first when given and
    missing (docker / podman)."""
    if isinstance(cfg, LocalSandboxConfig):
        return LocalSandbox(cfg)
    if image and dockerfile and context:
        if cfg.backend not in ("docker", "podman"):
            raise SandboxError(f"image {image}: building a task's Dockerfile needs backend docker or podman, "
                               f"not {cfg.backend} (build it and give its file as the task's image)")
        cli = cfg.cli or cfg.backend
        async with _builds.setdefault((id(asyncio.get_running_loop()), image), asyncio.Lock()):
            if not await asyncio.to_thread(images.image_exists, image, cli, cfg.runtime_args):
                await asyncio.to_thread(images.build_from_directory, image, dockerfile, context, cli, cfg.runtime_args)
    return await ContainerSandbox(cfg, image or cfg.image or "").start()


__all__ = [
    "ContainerSandbox",
    "ExecResult",
    "LocalSandbox",
    "Sandbox",
    "SandboxError",
    "build_sandbox",
]
