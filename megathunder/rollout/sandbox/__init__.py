"""Sandboxes that run an episode's tool calls: a local one (namespaces) and containers.

``build_sandbox(cfg, image)`` returns a ready sandbox for one episode; close it when done.
"""

from __future__ import annotations

from megathunder.rollout.sandbox.core import ExecResult, Sandbox, SandboxError
from megathunder.rollout.sandbox.container import ContainerSandbox
from megathunder.rollout.sandbox.local import LocalSandbox


async def build_sandbox(cfg, image: str | None = None) -> Sandbox:
    """``cfg`` is a :class:`megathunder.config.SandboxConfig`; ``image`` the task's container."""
    if cfg.backend == "local":
        return LocalSandbox(cfg)
    return await ContainerSandbox(cfg, image or "").start()


__all__ = [
    "ContainerSandbox",
    "ExecResult",
    "LocalSandbox",
    "Sandbox",
    "SandboxError",
    "build_sandbox",
]
