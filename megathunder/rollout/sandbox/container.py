"""Container sandboxes for clusters: Docker, Podman, Apptainer (Singularity) and Enroot.

Which are run for real: podman (Debian's package; images built offline by ``images.py``) runs
real episodes in ``tests/integration/test_podman_sandbox.py``; docker shares its command lines.
Apptainer and Enroot are checked only as argument lists against a stand-in CLI.

One container per episode, started from the task instance's image (e.g. a SWE-bench instance
image, whose repository lives at ``/testbed``), kept alive for the episode, every command run in it
with ``exec``, removed on close. Each runtime's command lines are built by pure functions so they
can be checked without the runtime (Docker's engine does not run on every machine).

The task's environment (``core.Environment``, its harness's settings) shapes the container: its
work directory (the task's own, else ``sandbox.workdir``, else the image's WORKDIR, read from the
running container), its network (docker/podman: the runtime's default network for a task whose
harness gives one, with ``sandbox.network=task``; else ``--network none``), its CPUs and memory
(the task's, else the ``sandbox`` section's).

Limits per runtime: Docker and Podman enforce all of them themselves (``--network none``: only a
loopback device; ``--memory`` = ``--memory-swap``: the container's cgroup, all its processes
together; ``--pids-limit``; ``--cpus``; ``--cap-drop ALL`` unless ``sandbox.drop_capabilities`` is
false; ``no-new-privileges``; a ``/tmp`` tmpfs counted in the memory limit). A command the cgroup's
OOM killer ends is reported as ``oom_killed`` (the container's own ``memory.oom_control`` /
``memory.events`` counter, read from inside it after a SIGKILL death), never as a hang. Killing the
``exec`` client does not stop what it started in the container, so each command records its process
group (``timeout`` leads one) in a file under the container's ``/tmp``; a command cancelled (the
episode's deadline) or cut by the host-side backstop has its group killed in the container before
``exec`` returns, so no stale tool process changes the state the verifier then scores. Apptainer
gets a separate network namespace with no interfaces (``--net --network none``; the host's network
for a task that needs one), ``--containall`` (own /tmp, /home, ipc and pid namespaces, clean
environment) and a writable tmpfs overlay. Enroot has no network or resource isolation of its own:
on Slurm, use it through pyxis with the job's cgroup limits. Every backend also wraps each command
in ``timeout``, ``prlimit`` (CPU time, memory, processes) inside the container -- the agent's tool
limits, or a test run's own (``core.CommandLimits``) -- and the host-side wall-time kill.
(``RLIMIT_NPROC`` does not bind uid 0, which the kernel exempts: in a root image the container's
``--pids-limit`` is the process limit.) A container that is gone mid-episode (removed, its runtime
restarted) raises ``SandboxError``: an infrastructure failure, not a failing command.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import re
import shutil
import uuid
from collections.abc import Sequence

from megathunder.config import ContainerSandboxConfig
from megathunder.rollout.sandbox.core import (
    CommandLimits,
    Environment,
    ExecResult,
    Sandbox,
    SandboxError,
    run_process,
)


def _limited(cfg: ContainerSandboxConfig, argv: Sequence[str], wall_s: float,
             limits: CommandLimits | None = None) -> list[str]:
    """Limits applied inside the container by coreutils/util-linux, present in common images: the
    agent's tool limits (``cfg``), or a test run's own (``limits``: an unset one is left out)."""
    if limits is None:
        cpu = max(1, int(cfg.cpu_time_s + 0.999))
        rlimits = [f"--cpu={cpu}:{cpu + 1}", f"--as={cfg.memory_mb << 20}", f"--nproc={cfg.max_processes}",
                   f"--fsize={cfg.max_file_size_mb << 20}"]
    else:
        rlimits = []
        if limits.cpu_time_s is not None:
            cpu = max(1, int(limits.cpu_time_s + 0.999))
            rlimits.append(f"--cpu={cpu}:{cpu + 1}")
        if limits.memory_mb is not None:
            rlimits.append(f"--as={limits.memory_mb << 20}")
        # not above the container's own hard limit (``--ulimit nproc``), which no command can raise
        rlimits.append(f"--nproc={min(limits.max_processes or cfg.max_processes, cfg.max_processes)}")
    return [
        "env", "PYTHONDONTWRITEBYTECODE=1",  # no stale .pyc hiding a same-size edit
        "timeout", "-s", "KILL", f"{wall_s:g}",
        "prlimit", *rlimits, "--",
        *argv,
    ]  # fmt: skip


LABEL = "megathunder.sandbox"
"""Every docker/podman container a sandbox starts carries this label (leftover checks, cleanup)."""


def _cli(cfg: ContainerSandboxConfig) -> list[str]:
    return [cfg.cli or cfg.backend, *cfg.runtime_args]


def _network(cfg: ContainerSandboxConfig, env: Environment | None) -> bool:
    """Whether the container gets a network: the task's harness gives one and the config allows."""
    return env is not None and env.network and cfg.network == "task"


def docker_start_argv(cfg: ContainerSandboxConfig, image: str, name: str, env: Environment | None = None) -> list[str]:
    """``env``: the task's environment (network, CPUs, memory, work directory); without a work
    directory from the task or the config, the image's WORKDIR applies."""
    memory = (env.memory_mb if env else None) or cfg.memory_mb
    cpus = (env.cpus if env else None) or cfg.cpus
    workdir = (env.workdir if env else None) or cfg.workdir
    return [
        *_cli(cfg), "run", "--detach", "--rm", "--name", name, "--label", f"{LABEL}=1",
        *([] if _network(cfg, env) else ["--network", "none"]),
        "--memory", f"{memory}m", "--memory-swap", f"{memory}m",
        "--pids-limit", str(cfg.max_processes), "--cpus", f"{cpus:g}",
        *(["--cap-drop", "ALL"] if cfg.drop_capabilities else []), "--security-opt", "no-new-privileges",
        "--ulimit", f"nofile={cfg.max_open_files}:{cfg.max_open_files}",
        "--ulimit", f"nproc={cfg.max_processes}:{cfg.max_processes}",
        "--tmpfs", f"/tmp:size={cfg.tmpfs_mb}m", *(["--workdir", workdir] if workdir else []),
        *cfg.extra_args, "--entrypoint", "sleep", image, "infinity",
    ]  # fmt: skip


def docker_exec_argv(
    cfg: ContainerSandboxConfig,
    name: str,
    argv: Sequence[str],
    interactive: bool,
    wall_s: float,
    pid_file: str | None = None,
    stale: Sequence[str] = (),
    workdir: str | None = None,
    limits: CommandLimits | None = None,
) -> list[str]:
    """``pid_file``: where the command's process group id goes (for :meth:`ContainerSandbox.
    _kill_group`); ``stale``: the files of finished commands, removed first; ``workdir``: where it
    runs (None: the container's); ``limits``: a test run's own (else the agent's, ``cfg``)."""
    track = []
    if pid_file is not None:  # pid $$ execs env, then timeout, which leads its own process group
        script = 'rm -f $1; echo $$ > "$0"; [ -e "$0.cancel" ] && exit 137; shift; exec "$@"'
        track = ["sh", "-c", script, pid_file, " ".join(stale) or "/nonexistent"]
    return [
        *_cli(cfg), "exec", *(["--interactive"] if interactive else []),
        *(["--workdir", workdir] if workdir else []), name, *track, *_limited(cfg, argv, wall_s, limits),
    ]  # fmt: skip


def docker_stop_argv(cfg: ContainerSandboxConfig, name: str) -> list[str]:
    return [*_cli(cfg), "rm", "--force", name]


def podman_stop_argv(cfg: ContainerSandboxConfig, name: str) -> list[str]:
    # without --time 0 podman first waits 10 s for `sleep` (pid 1, which ignores SIGTERM)
    return [*_cli(cfg), "rm", "--force", "--time", "0", name]


DEFAULT_WORKDIR = "/workspace"
"""apptainer / enroot: the work directory when neither the task nor the config names one."""


def _fixed_workdir(cfg: ContainerSandboxConfig, env: Environment | None) -> str:
    return (env.workdir if env else None) or cfg.workdir or DEFAULT_WORKDIR


def apptainer_start_argv(cfg: ContainerSandboxConfig, image: str, name: str, env: Environment | None = None) -> list[str]:
    return [
        cfg.cli or "apptainer", "instance", "start", "--containall", "--cleanenv",
        *([] if _network(cfg, env) else ["--net", "--network", "none"]), "--writable-tmpfs", "--no-home",
        "--pwd", _fixed_workdir(cfg, env), *cfg.extra_args, image, name,
    ]  # fmt: skip


def apptainer_exec_argv(
    cfg: ContainerSandboxConfig, name: str, argv: Sequence[str], interactive: bool, wall_s: float,
    workdir: str | None = None, limits: CommandLimits | None = None,
) -> list[str]:
    del interactive  # apptainer exec always forwards stdin
    return [
        cfg.cli or "apptainer", "exec", "--pwd", workdir or _fixed_workdir(cfg, None),
        f"instance://{name}", *_limited(cfg, argv, wall_s, limits),
    ]  # fmt: skip


def apptainer_stop_argv(cfg: ContainerSandboxConfig, name: str) -> list[str]:
    return [cfg.cli or "apptainer", "instance", "stop", name]


def enroot_start_argv(cfg: ContainerSandboxConfig, image: str, name: str, env: Environment | None = None) -> list[str]:
    return [cfg.cli or "enroot", "create", "--name", name, image]


def enroot_exec_argv(
    cfg: ContainerSandboxConfig, name: str, argv: Sequence[str], interactive: bool, wall_s: float,
    workdir: str | None = None, limits: CommandLimits | None = None,
) -> list[str]:
    del interactive
    return [
        cfg.cli or "enroot", "start", "--rw", *cfg.extra_args, name,
        "sh", "-c", 'cd "$0" && exec "$@"', workdir or _fixed_workdir(cfg, None), *_limited(cfg, argv, wall_s, limits),
    ]  # fmt: skip


def enroot_stop_argv(cfg: ContainerSandboxConfig, name: str) -> list[str]:
    return [cfg.cli or "enroot", "remove", "--force", name]


_RUNTIMES = {
    "docker": (docker_start_argv, docker_exec_argv, docker_stop_argv),
    "podman": (docker_start_argv, docker_exec_argv, podman_stop_argv),
    "apptainer": (apptainer_start_argv, apptainer_exec_argv, apptainer_stop_argv),
    "enroot": (enroot_start_argv, enroot_exec_argv, enroot_stop_argv),
}


def check_image(backend: str, image: str) -> None:
    """Apptainer and Enroot images are files (.sif / .sqsh): fail early, naming the file."""
    if backend in ("apptainer", "enroot") and "://" not in image and not os.path.exists(image):
        raise SandboxError(f"{backend} image file not found: {image}")


_RUNTIME_ERROR = re.compile(r"^Error", re.M)
"""How docker / podman report their own failures (a container gone: exit 1, 125 or 126)."""


class ContainerSandbox(Sandbox):
    """Created with :meth:`start`; one container per episode. ``environment``: the task's (network,
    CPUs, memory, work directory); None: the ``sandbox`` section's settings alone."""

    def __init__(self, cfg: ContainerSandboxConfig, image: str, environment: Environment | None = None) -> None:
        if not image:
            raise SandboxError(
                f"sandbox.backend={cfg.backend} needs a container image for the task"
            )
        self.cfg, self.image, self.env = cfg, image, environment
        self.name = f"megathunder-{uuid.uuid4().hex[:12]}"
        self.workdir = (environment.workdir if environment else None) or cfg.workdir or DEFAULT_WORKDIR
        self._docker = cfg.backend in ("docker", "podman")
        self._exec_workdir = (environment.workdir if environment else None) or cfg.workdir  # None: the image's
        self._start, _, self._stop = _RUNTIMES[cfg.backend]
        self.memory_mb = (environment.memory_mb if environment else None) or cfg.memory_mb
        self._started = False
        self._oom_kills = 0  # the container's cgroup counter as last read
        self._tracked = self._docker  # exec'd processes outlive the client
        self._exec_ids = itertools.count()
        self._finished: list[str] = []  # pid files of finished commands, removed by the next one

    async def start(self) -> ContainerSandbox:
        cli = self.cfg.cli or self.cfg.backend
        if shutil.which(cli) is None:
            raise SandboxError(f"sandbox.backend={self.cfg.backend}: {cli!r} is not on PATH")
        check_image(self.cfg.backend, self.image)
        try:
            result = await self._run(self._start(self.cfg, self.image, self.name, self.env), None, 600.0)
        except BaseException:  # cancelled or failed mid-start: a container may exist already
            await self._remove()
            raise
        if not result.ok:
            await self._remove()
            raise SandboxError(
                f"cannot start {self.cfg.backend} container from image {self.image!r}: "
                f"{result.observation().strip()}"
            )
        self._started = True
        if self._docker:  # the image's WORKDIR (where no work dir was given) and the OOM counter
            try:
                workdir, self._oom_kills = await self._probe()
            except BaseException:
                await self.close()
                raise
            if self._exec_workdir is None:
                self.workdir = workdir or "/"
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
        limits: CommandLimits | None = None,
    ) -> ExecResult:
        if not self._started:
            raise SandboxError("container sandbox not started (call start())")
        wall_s = limits.wall_time_s if limits is not None else timeout_s or self.cfg.wall_time_s
        out_bytes = max_output_bytes or (limits.max_output_bytes if limits is not None else None)
        if not self._tracked:
            builder = apptainer_exec_argv if self.cfg.backend == "apptainer" else enroot_exec_argv
            full = builder(self.cfg, self.name, argv, stdin is not None, wall_s, self.workdir, limits)
            # The host-side kill is a little later than the in-container `timeout`, a backstop.
            return await self._check_gone(await self._run(full, stdin, wall_s + 5.0, out_bytes))
        pid_file = f"/tmp/.megathunder-exec-{self.name}-{next(self._exec_ids)}"
        stale, self._finished = self._finished, []
        full = docker_exec_argv(self.cfg, self.name, argv, stdin is not None, wall_s, pid_file, stale,
                                self._exec_workdir, limits)
        try:
            result = await self._run(full, stdin, wall_s + 5.0, out_bytes)
        except asyncio.CancelledError:
            await asyncio.shield(self._kill_group(pid_file))
            raise
        result = dataclasses.replace(result, cpu_limit_s=limits.cpu_time_s if limits else self.cfg.cpu_time_s)
        if result.timed_out:
            await self._kill_group(pid_file)
        else:
            self._finished.append(pid_file)
        # a SIGKILL (the wall-time limit or the OOM killer), or a test run (a test script that goes on
        # after one of its processes was killed still reports it)
        if result.exit_code == 137 or result.timed_out or limits is not None:
            kills = await self._read_oom_kills()
            if kills > self._oom_kills:
                self._oom_kills = kills
                result = dataclasses.replace(result, oom_killed=True, memory_limit_mb=self.memory_mb)
        return await self._check_gone(result)

    async def _check_gone(self, result: ExecResult) -> ExecResult:
        """Raise for a container that is gone (the runtime's own error, not the command's): only
        when the output says so and the runtime confirms the container is not running."""
        if not self._docker or result.exit_code not in (1, 125, 126) or not _RUNTIME_ERROR.search(result.output):
            return result
        argv = [*_cli(self.cfg), "container", "inspect", "--format", "{{.State.Running}}", self.name]
        state = await self._run(argv, None, 60.0, 4096)
        if state.ok and state.output.strip() == "true":
            return result
        raise SandboxError(f"sandbox lost: {self.cfg.backend} container {self.name} is not running "
                           f"({result.output.strip()[-200:]})")

    async def _kill_group(self, pid_file: str) -> None:
        """Kill, inside the container, the process group of a command whose client was killed.

        No race with a command that starts late (a loaded host): this marks the command
        cancelled, then reads its group id; the command writes its id, then reads the mark. So
        either this sees the id and kills the group, or the command sees the mark and exits."""
        script = (
            'touch "$0.cancel"; [ -s "$0" ] && { P=$(cat "$0"); for d in /proc/[0-9]*; do '
            'g=$(sed "s/.*) //" "$d/stat" 2>/dev/null | cut -d" " -f3); '
            '[ "$g" = "$P" ] && kill -9 "${d#/proc/}" 2>/dev/null; done; }; true'
        )  # by pid, from /proc: dash's kill takes no negative (group) ids, procps is not there
        # the mark stays (a few bytes): a command starting after its removal would run after all
        argv = [*_cli(self.cfg), "exec", self.name, "sh", "-c", script, pid_file]
        await self._run(argv, None, 30.0, 4096)

    _OOM_PROBE = ("cat /sys/fs/cgroup/memory.events 2>/dev/null || "
                  "cat /sys/fs/cgroup/memory/memory.oom_control 2>/dev/null")
    """The container's cgroup OOM-kill counter, read inside it (its own cgroup is mounted at
    /sys/fs/cgroup: v2 ``memory.events``, v1 ``memory/memory.oom_control``)."""

    async def _probe(self) -> tuple[str, int]:
        """(the container's work directory, its OOM-kill counter), in one ``exec``."""
        argv = [*_cli(self.cfg), "exec", self.name, "sh", "-c", "pwd; " + self._OOM_PROBE]
        out = await self._run(argv, None, 60.0, 4096)
        if out.exit_code != 0 and not out.output.strip():
            raise SandboxError(f"container {self.name} from {self.image!r} cannot run commands "
                               f"(exit {out.exit_code}; a shell at /bin/sh is needed)")
        lines = out.output.splitlines()
        return (lines[0].strip() if lines and lines[0].startswith("/") else ""), _oom_count(lines)

    async def _read_oom_kills(self) -> int:
        argv = [*_cli(self.cfg), "exec", self.name, "sh", "-c", self._OOM_PROBE]
        return _oom_count((await self._run(argv, None, 30.0, 4096)).output.splitlines())

    async def _remove(self) -> None:
        # shielded: an episode cancelled while closing still removes its container
        await asyncio.shield(self._run(self._stop(self.cfg, self.name), None, 60.0))

    async def close(self) -> None:
        if self._started:
            self._started = False
            await self._remove()


def _oom_count(lines: Sequence[str]) -> int:
    for line in lines:
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return 0
