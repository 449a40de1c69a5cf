"""Sandboxes that run an episode's tool calls: a local one (namespaces) and containers.

``build_sandbox(cfg, image)`` returns a ready sandbox for one episode; close it when done.
"""

from __future__ import annotations

from megathunder.config import LocalSandboxConfig, SandboxConfig
from megathunder.rollout.sandbox.container import ContainerSandbox
from megathunder.rollout.sandbox.core import ExecResult, Sandbox, SandboxError
from megathunder.rollout.sandbox.local import LocalSandbox


async def build_sandbox(cfg: SandboxConfig, image: str | None = None) -> Sandbox:
    """A sandbox of the ``sandbox`` section's backend; ``image``: the task instance's container
    image (else ``sandbox.image``)."""
    if isinstance(cfg, LocalSandboxConfig):
        return LocalSandbox(cfg)
    return await ContainerSandbox(cfg, image or cfg.image or "").start()


__all__ = [
    "ContainerSandbox",
    "ExecResult",
    "LocalSandbox",
    "Sandbox",
    "SandboxError",
    "build_sandbox",
]
