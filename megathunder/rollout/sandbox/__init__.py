"""Sandboxes that run an episode's tool calls: a local one (namespaces), containers, and either of
them on sandbox servers (``backend: remote``: ``remote.py``, served by ``megathunder sandbox serve``,
``sandbox_server.py``).

``build_sandbox(cfg, image, environment=...)`` returns a ready sandbox for one episode; close it
when done. A task instance that brings its own environment (a Terminal-Bench / Harbor task
directory's Dockerfile, a SWE record's repository directory, its harness's network, CPU and memory
settings) passes it as ``environment``: a docker or podman backend builds ``image`` from its
Dockerfile once per process (episodes of the same task wait for the one build) unless the image
exists; a backend that cannot provide the environment raises :class:`SandboxError` naming the task
and what it lacks (an infrastructure failure of the episode), never runs the task without it.
"""

from __future__ import annotations

import asyncio
import time

from megathunder.config import ContainerSandboxConfig, LocalSandboxConfig, RemoteSandboxConfig, SandboxConfig
from megathunder.rollout.sandbox import images
from megathunder.rollout.sandbox.container import ContainerSandbox
from megathunder.rollout.sandbox.core import (
    CommandLimits,
    Environment,
    ExecResult,
    ImageBuild,
    LocalLayout,
    Sandbox,
    SandboxError,
)
from megathunder.rollout.sandbox.local import LocalSandbox


_builds: dict[tuple[int, str], asyncio.Lock] = {}  # (event loop, image): one build at a time


async def prepare_image(cfg: ContainerSandboxConfig, image: str, environment: Environment | None) -> float:
    """Build ``image`` from the environment's Dockerfile when missing (docker / podman); returns the
    build's seconds (0 when the image existed). Raises :class:`SandboxError` for an environment
    this backend cannot build (a compose file with several services, apptainer / enroot)."""
    build = environment.build if environment is not None else None
    if build is None:
        return 0.0
    name = environment.name if environment is not None else image
    if build.dockerfile is None:
        raise SandboxError(f"task {name}: {build.compose_file}: a docker-compose environment of several services; "
                           "only one-container environments (a Dockerfile) are run")
    if cfg.backend not in ("docker", "podman"):
        raise SandboxError(f"task {name}: image {image}: building a task's Dockerfile needs backend docker or "
                           f"podman, not {cfg.backend} (build it and give its file as the task's image)")
    cli = cfg.cli or cfg.backend
    async with _builds.setdefault((id(asyncio.get_running_loop()), image), asyncio.Lock()):
        if await asyncio.to_thread(images.image_exists, image, cli, cfg.runtime_args):
            return 0.0
        start = time.monotonic()
        network = environment is not None and environment.network and cfg.network == "task"
        await asyncio.to_thread(images.build_from_directory, image, build.dockerfile, build.context, cli,
                                cfg.runtime_args, build.timeout_s, network)
        return time.monotonic() - start


async def build_sandbox(cfg: SandboxConfig, image: str | None = None, *,
                        environment: Environment | None = None) -> Sandbox:
    """A sandbox of the ``sandbox`` section's backend; ``image``: the task instance's container
    image (else ``sandbox.image``), built from its environment's Dockerfile first when missing
    (docker / podman); ``environment``: what the task needs of its sandbox. Remote: on the least
    loaded sandbox server, which builds the image there."""
    if isinstance(cfg, RemoteSandboxConfig):
        from megathunder.rollout.sandbox.remote import create_remote  # aiohttp only where it is used

        return await create_remote(cfg, image, environment)
    if isinstance(cfg, LocalSandboxConfig):
        return LocalSandbox(cfg, environment)
    image = image or cfg.image or ""
    if image:
        await prepare_image(cfg, image, environment)
    return await ContainerSandbox(cfg, image, environment).start()


def sandbox_server_counts() -> dict:
    """Per sandbox server (``backend: remote``) the episodes this event loop placed there and
    whether it was lost, and the failovers: the run's summary (empty without sandbox servers)."""
    from megathunder.rollout.sandbox.server_pool import pools

    servers: dict = {}
    failovers = 0
    for pool in pools():
        stats = pool.stats()
        failovers += stats["failovers"]
        for url, s in stats["servers"].items():
            prev = servers.get(url, {"episodes": 0, "lost": False})
            servers[url] = {"episodes": prev["episodes"] + s["episodes"], "lost": prev["lost"] or s["lost"] is not None}
    return {"sandbox_servers": servers, "sandbox_failovers": failovers} if servers else {}


async def close_sandbox_pools() -> None:
    """Close this event loop's connections to sandbox servers (``backend: remote``), if any."""
    from megathunder.rollout.sandbox.server_pool import close_pools

    await close_pools()


__all__ = [
    "CommandLimits",
    "ContainerSandbox",
    "Environment",
    "ExecResult",
    "ImageBuild",
    "LocalLayout",
    "LocalSandbox",
    "Sandbox",
    "SandboxError",
    "build_sandbox",
    "close_sandbox_pools",
    "prepare_image",
    "sandbox_server_counts",
]
