"""What the podman tests share: the Debian base image (built once per machine, a no-op when it
exists) and the probed runtime options, or the reason none can run -- a skip, except under
tools/test.sh as root (MEGATHUNDER_REQUIRE_PODMAN=1), where a missing or broken runtime fails."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from megathunder.config import ContainerSandboxConfig
from megathunder.rollout.sandbox import SandboxError, images


def podman_base() -> tuple[str, list[str]]:
    """(base image tag, runtime_args) -- see the module docstring."""
    unavailable = pytest.fail if os.environ.get("MEGATHUNDER_REQUIRE_PODMAN") == "1" else pytest.skip
    if shutil.which("podman") is None:
        unavailable("podman not installed (tools/test.sh installs it as root: apt-get install podman)")
    tag = f"{images.BASE_REPOSITORY}:{images.base_image_key()}"
    if not images.image_exists(tag) and (shutil.which("debootstrap") is None or os.geteuid() != 0):
        unavailable("no base image and no way to build one (needs root and debootstrap)")
    try:
        base = images.build_base_image()
        runtime_args = images.probe_runtime(image=base.tag)
    except SandboxError as err:
        unavailable(f"no container runtime works here: {err}")
    return base.tag, runtime_args


def podman_cfg(podman: tuple[str, list[str]], **kw) -> ContainerSandboxConfig:
    tag, runtime_args = podman
    fields = {"backend": "podman", "image": tag, "runtime_args": runtime_args,
              "wall_time_s": 20, "cpu_time_s": 10, "memory_mb": 256, "max_processes": 64, **kw}  # fmt: skip
    return ContainerSandboxConfig(**fields)


def remove_images(tags, runtime_args=()) -> None:
    """Remove the images a test built (by tag; others' images are left alone)."""
    for tag in tags:
        subprocess.run(["podman", *runtime_args, "rmi", "-f", tag], capture_output=True, timeout=120)
