"""Container sandboxes for clusters: Docker, Apptainer (Singularity) and Enroot.

One container per episode, started from the task instance's image (e.g. a SWE-bench instance
image, whose repository lives at ``/testbed``), kept alive for the episode, every command run in it
with ``exec``, removed on close. Each runtime's command lines are built by pure functions so they
can be checked without the runtime (Docker's engine does not run on every machine).

Limits per runtime: Docker enforces all of them itself (``--network none``, ``--memory``,
``--pids-limit``, ``--cpus``, read-only root with a writable work dir). Apptainer gets a separate
network namespace with no interfaces (``--net --network none``), ``--containall`` (own /tmp,
/home, ipc and pid namespaces, clean environment) and a writable tmpfs overlay. Enroot has no
network or resource isolation of its own: on Slurm, use it through pyxis with the job's cgroup
limits. Every backend also wraps each command in ``timeout``, ``prlimit`` (CPU time, memory,
processes) inside the container, and the host-side wall-time kill.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence

from megathunder.config import ContainerSandboxConfig
from megathunder.rollout.sandbox.core import ExecResult, Sandbox, SandboxError, run_process


def _limited(cfg: ContainerSandboxConfig, argv: Sequence[str], wall_s: float) -> list[str]:
    """Limits applied inside the container by coreutils/util-linux, present in common images."""
    cpu = max(1, int(cfg.cpu_time_s + 0.999))
    return [
        "env", "PYTHONDONTWRITEBYTECODE=1",  # no stale .pyc hiding a same-size edit
        "timeout", "-s", "KILL", f"{wall_s:g}",
        "prlimit", f"--cpu={cpu}:{cpu + 1}", f"--as={cfg.memory_mb << 20}",
        f"--nproc={cfg.max_processes}", f"--fsize={cfg.max_file_size_mb << 20}", "--",
        *argv,
    ]  # fmt: skip


def docker_start_argv(cfg: ContainerSandboxConfig, image: str, name: str) -> list[str]:
    return [
        cfg.cli or "docker", "run", "--detach", "--rm", "--name", name,
        "--network", "none", "--memory", f"{cfg.memory_mb}m", "--memory-swap", f"{cfg.memory_mb}m",
        "--pids-limit", str(cfg.max_processes), "--cpus", f"{cfg.cpus:g}",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "--tmpfs", f"/tmp:size={cfg.tmpfs_mb}m", "--workdir", cfg.workdir,
        *cfg.extra_args, "--entrypoint", "sleep", image, "infinity",
    ]  # fmt: skip


def docker_exec_argv(
    cfg: ContainerSandboxConfig, name: str, argv: Sequence[str], interactive: bool, wall_s: float
) -> list[str]:
    return [
        cfg.cli or "docker", "exec", *(["--interactive"] if interactive else []),
        "--workdir", cfg.workdir, name, *_limited(cfg, argv, wall_s),
    ]  # fmt: skip


def docker_stop_argv(cfg: ContainerSandboxConfig, name: str) -> list[str]:
    return [cfg.cli or "docker", "rm", "--force", name]


def apptainer_start_argv(cfg: ContainerSandboxConfig, image: str, name: str) -> list[str]:
    return [
        cfg.cli or "apptainer", "instance", "start", "--containall", "--cleanenv",
        "--net", "--network", "none", "--writable-tmpfs", "--no-home",
        "--pwd", cfg.workdir, *cfg.extra_args, image, name,
    ]  # fmt: skip


def apptainer_exec_argv(
    cfg: ContainerSandboxConfig, name: str, argv: Sequence[str], interactive: bool, wall_s: float
) -> list[str]:
    del interactive  # apptainer exec always forwards stdin
    return [
        cfg.cli or "apptainer", "exec", "--pwd", cfg.workdir,
        f"instance://{name}", *_limited(cfg, argv, wall_s),
    ]  # fmt: skip


def apptainer_stop_argv(cfg: ContainerSandboxConfig, name: str) -> list[str]:
    return [cfg.cli or "apptainer", "instance", "stop", name]


def enroot_start_argv(cfg: ContainerSandboxConfig, image: str, name: str) -> list[str]:
    return [cfg.cli or "enroot", "create", "--name", name, image]


def enroot_exec_argv(
    cfg: ContainerSandboxConfig, name: str, argv: Sequence[str], interactive: bool, wall_s: float
) -> list[str]:
    del interactive
    return [
        cfg.cli or "enroot", "start", "--rw", *cfg.extra_args, name,
        "sh", "-c", 'cd "$0" && exec "$@"', cfg.workdir, *_limited(cfg, argv, wall_s),
    ]  # fmt: skip


def enroot_stop_argv(cfg: ContainerSandboxConfig, name: str) -> list[str]:
    return [cfg.cli or "enroot", "remove", "--force", name]


_RUNTIMES = {
    "docker": (docker_start_argv, docker_exec_argv, docker_stop_argv),
    "apptainer": (apptainer_start_argv, apptainer_exec_argv, apptainer_stop_argv),
    "enroot": (enroot_start_argv, enroot_exec_argv, enroot_stop_argv),
}


def check_image(backend: str, image: str) -> None:
    """Apptainer and Enroot images are files (.sif / .sqsh): fail early, naming the file."""
    if backend in ("apptainer", "enroot") and "://" not in image and not os.path.exists(image):
        raise SandboxError(f"{backend} image file not found: {image}")


class ContainerSandbox(Sandbox):
    """Created with :meth:`start`; one container per episode."""

    def __init__(self, cfg: ContainerSandboxConfig, image: str) -> None:
        if not image:
            raise SandboxError(
                f"sandbox.backend={cfg.backend} needs a container image for the task"
            )
        self.cfg, self.image = cfg, image
        self.name = f"megathunder-{uuid.uuid4().hex[:12]}"
        self.workdir = cfg.workdir
        self._start, self._exec, self._stop = _RUNTIMES[cfg.backend]
        self._started = False

    async def start(self) -> ContainerSandbox:
        cli = self.cfg.cli or self.cfg.backend
        if shutil.which(cli) is None:
            raise SandboxError(f"sandbox.backend={self.cfg.backend}: {cli!r} is not on PATH")
        check_image(self.cfg.backend, self.image)
        result = await self._run(self._start(self.cfg, self.image, self.name), None, 600.0)
        if not result.ok:
            raise SandboxError(
                f"cannot start {self.cfg.backend} container from image {self.image!r}: "
                f"{result.observation().strip()}"
            )
        self._started = True
        return self

    async def _run(self, argv, stdin, timeout_s, max_output_bytes=None) -> ExecResult:
        return await run_process(
            argv, stdin=stdin, timeout_s=timeout_s,
            max_output_bytes=max_output_bytes or self.cfg.max_output_bytes,
            cpu_limit_s=self.cfg.cpu_time_s,
        )  # fmt: skip

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        max_output_bytes: int | None = None,
    ) -> ExecResult:
        if not self._started:
            raise SandboxError("container sandbox not started (call start())")
        wall_s = timeout_s or self.cfg.wall_time_s
        full = self._exec(self.cfg, self.name, argv, stdin is not None, wall_s)
        # The host-side kill is a little later than the in-container `timeout`, as a backstop.
        return await self._run(full, stdin, wall_s + 5.0, max_output_bytes)

    async def close(self) -> None:
        if self._started:
            self._started = False
            await self._run(self._stop(self.cfg, self.name), None, 60.0)
