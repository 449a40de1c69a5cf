"""What every sandbox backend provides: run a command under limits, and move files in and out.

All file access goes *through* the sandbox (a command run inside it), never through the host's
filesystem: a symlink the model planted cannot make the host write outside the work dir.

A command runs under the sandbox's own limits (the agent's tool limits, ``sandbox.*``) unless it
passes :class:`CommandLimits` of its own (a test run: ``task.test_run``). A task instance that
needs something of its sandbox says so in an :class:`Environment` (its harness's settings: the
work directory, the network, CPUs and memory, the image to build); a backend that cannot provide
it raises :class:`SandboxError` naming what it lacks, never runs the task without it.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import io
import os
import shlex
import signal
import tarfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from megathunder.rollout.verifiers import InfrastructureError


class SandboxError(InfrastructureError):
    """The sandbox itself could not be set up or used (not a failing command: that is a result):
    an infrastructure failure of the episode."""


@dataclass(frozen=True)
class CommandLimits:
    """Limits of one command, replacing the sandbox's own for it (a test run's). None: no such
    limit beyond the sandbox's whole-tree ones (the container's or cgroup's memory and pids)."""

    wall_time_s: float
    cpu_time_s: float | None = None
    memory_mb: int | None = None  # per process address space
    max_processes: int | None = None
    max_output_bytes: int | None = None


@dataclass(frozen=True)
class ImageBuild:
    """A task's own environment: ``docker build -f dockerfile context`` (tagged with the instance's
    image), or a docker-compose file (``compose_services``: its services) that container backends
    refuse unless it is the one-service layout Terminal-Bench 1 ships (then ``dockerfile`` is set)."""

    context: str  # directory on this machine
    dockerfile: str | None = None  # path on this machine; None with a compose file
    compose_file: str | None = None
    timeout_s: float = 1800.0  # Harbor's [environment] build_timeout_sec


@dataclass(frozen=True)
class LocalLayout:
    """What the local sandbox (no images) can lay out of a task's environment: the files its
    Dockerfile copies into its work directory. ``refusal`` says why it cannot (a ``RUN`` step, a
    file copied elsewhere, a compose file, a prebuilt image), naming the file and line."""

    workdir: str | None = None  # the Dockerfile's WORKDIR (absolute)
    files: Mapping[str, bytes] = field(default_factory=dict)  # workdir-relative path -> content
    refusal: str | None = None


@dataclass(frozen=True)
class Environment:
    """What a task instance needs of its sandbox, as its harness provides it.

    ``workdir``: where commands run (None: the image's WORKDIR); ``network``: a network (else only
    loopback); ``cpus`` / ``memory_mb``: the container's (None: the sandbox section's);
    ``scratch_dirs``: absolute directories the harness writes (``/tests``, ``/logs``), which the
    local sandbox makes writable; ``build``: how to build the instance's image when missing;
    ``local``: what the local sandbox can lay out instead (None: nothing is needed)."""

    name: str  # the task, for errors
    workdir: str | None = None
    network: bool = False
    cpus: float | None = None
    memory_mb: int | None = None
    scratch_dirs: tuple[str, ...] = ()
    build: ImageBuild | None = None
    local: LocalLayout | None = None


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None  # None when the command was killed at the wall-time limit
    output: str  # stdout and stderr interleaved, cut at the output limit
    duration_s: float
    timed_out: bool = False
    output_truncated: bool = False
    cpu_limit_s: float | None = None
    wall_limit_s: float | None = None
    oom_killed: bool = False  # the sandbox's cgroup memory limit killed a process of this command
    memory_limit_mb: int | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def error(self) -> str | None:
        """Why the command failed, in words for the model; None if it exited 0."""
        if self.timed_out:
            return f"command killed: wall-time limit of {self.wall_limit_s:g} s exceeded"
        if self.oom_killed:
            mib = self.memory_limit_mb
            return f"command killed: the sandbox's memory limit of {mib} MiB was exceeded"
        if self.exit_code == 0:
            return None
        code = self.exit_code
        if code is not None and code > 128 and code - 128 in _SIGNALS:
            sig = code - 128
            cpu = f" of {self.cpu_limit_s:g} s" if self.cpu_limit_s else ""
            reasons: dict[int, str] = {
                signal.SIGXCPU: f"CPU-time limit{cpu} exceeded",
                signal.SIGKILL: "killed (memory or process limit, or the CPU-time hard limit)",
                signal.SIGSEGV: "segmentation fault (often the memory limit)",
                signal.SIGXFSZ: "file-size limit exceeded",
            }
            why = reasons.get(sig, "")
            return f"command terminated by signal {_SIGNALS[sig]}" + (f": {why}" if why else "")
        return f"command failed with exit code {code}"

    def observation(self) -> str:
        """What the model sees: the output, then a clear line if something went wrong."""
        text = self.output
        if self.output_truncated:
            text += "\n[output truncated]"
        err = self.error()
        if err is None:
            return text
        return f"{text}\n[error: {err}]" if text else f"[error: {err}]"


_SIGNALS = {s.value: s.name for s in signal.Signals}


class Sandbox(abc.ABC):
    """One episode's isolated environment. ``workdir`` is the work directory as commands see it;
    ``tmp_dir`` a writable scratch directory outside it (the verifier's scripts go there)."""

    workdir: str
    tmp_dir: str = "/tmp"

    @abc.abstractmethod
    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        max_output_bytes: int | None = None,
        limits: CommandLimits | None = None,
    ) -> ExecResult:
        """Run ``argv`` in ``workdir``; never raises for a failing, hung or crashing command (a
        sandbox that is gone raises :class:`SandboxError`). ``max_output_bytes`` overrides the
        configured output limit (tools reading whole files); ``limits`` replace the sandbox's own
        limits for this command (``timeout_s`` and ``max_output_bytes`` then come from them)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Kill anything still running and delete the sandbox's state."""

    async def shell(self, command: str, *, timeout_s: float | None = None) -> ExecResult:
        return await self.exec(["sh", "-c", command], timeout_s=timeout_s)

    async def bash(self, command: str, *, timeout_s: float | None = None) -> ExecResult:
        """``command`` under bash (the bash tool, a task's set-up): benchmark images have it, and
        their tasks' commands are written for it (``sh`` is dash on Debian and Ubuntu)."""
        return await self.exec(["bash", "-c", command], timeout_s=timeout_s)

    async def upload(self, files: Mapping[str, str | bytes]) -> None:
        """Create ``files`` (paths relative to ``workdir``) by streaming a tar archive in."""
        await self.upload_tar(tar_archive(files), len(files))

    async def upload_tar(self, archive: bytes, num_files: int | None = None) -> None:
        """Extract a tar ``archive`` in ``workdir`` (a command run inside the sandbox)."""
        result = await self.exec(["tar", "-x", "--no-same-owner", "-f", "-"], stdin=archive)
        if not result.ok:
            what = f"{num_files} files" if num_files is not None else f"a {len(archive)}-byte archive"
            raise SandboxError(f"upload of {what} failed: {result.observation()}")

    async def download(self, path: str, max_bytes: int = 64 << 20) -> bytes:
        """A tar archive of ``path`` (relative to ``workdir``, a file or a directory), made inside the
        sandbox (base64 on the way out: command output is text). Raises :class:`SandboxError` when
        it cannot be read or exceeds ``max_bytes``."""
        # tar's own complaints land in the output too: then it does not decode, and the download fails
        script = '[ -e "$1" ] || { echo "no such file: $1"; exit 2; }; tar -c -f - -- "$1" | base64 | tr -d "\\n"'
        result = await self.exec(["sh", "-c", script, "sh", path], max_output_bytes=max_bytes * 4 // 3 + 8)
        if not result.ok:
            raise SandboxError(f"download of {path!r} failed: {result.observation()[-500:]}")
        if result.output_truncated:
            raise SandboxError(f"download of {path!r}: larger than {max_bytes} bytes")
        try:
            return base64.b64decode(result.output, validate=True)
        except ValueError as err:
            raise SandboxError(f"download of {path!r}: not an archive ({err})") from None

    async def read_file(self, path: str, max_bytes: int | None = None) -> ExecResult:
        return await self.exec(["cat", "--", path], max_output_bytes=max_bytes)

    async def write_file(self, path: str, content: str) -> ExecResult:
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        return await self.exec(["sh", "-c", script, "sh", path], stdin=content.encode())


def tar_archive(files: Mapping[str, str | bytes]) -> bytes:
    """``files`` (relative path -> content) as an uncompressed tar archive, mode 0644."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, content in files.items():
            data = content.encode() if isinstance(content, str) else content
            info = tarfile.TarInfo(path)
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def shell_join(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


async def run_process(
    argv: Sequence[str],
    *,
    stdin: bytes | None,
    timeout_s: float,
    max_output_bytes: int,
    cpu_limit_s: float | None = None,
    **popen_kwargs,
) -> ExecResult:
    """Run a process in its own session; at ``timeout_s`` kill its whole process group.

    Output beyond ``max_output_bytes`` is drained and dropped, so a command printing forever
    neither blocks on a full pipe nor fills the host's memory.
    """
    start = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            **popen_kwargs,
        )
    except OSError as err:
        raise SandboxError(f"cannot start {argv[0]!r}: {err}") from err
    chunks: list[bytes] = []
    size = 0

    async def pump() -> None:
        nonlocal size
        assert proc.stdout is not None  # stdout=PIPE
        if stdin is not None:
            assert proc.stdin is not None  # stdin=PIPE
            try:
                proc.stdin.write(stdin)
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass
            proc.stdin.close()
        while chunk := await proc.stdout.read(65536):
            if size < max_output_bytes:
                chunks.append(chunk[: max_output_bytes - size])
            size += len(chunk)
        await proc.wait()

    timed_out = False
    try:
        await asyncio.wait_for(pump(), timeout_s)
    except TimeoutError:
        timed_out = True
    finally:
        if proc.returncode is None:
            _kill_group(proc.pid)
            await proc.wait()
    assert proc.returncode is not None  # waited for above
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode  # -N: signal N
    return ExecResult(
        exit_code=None if timed_out else code,
        output=b"".join(chunks).decode(errors="replace"),
        duration_s=time.monotonic() - start,
        timed_out=timed_out,
        output_truncated=size > max_output_bytes,
        cpu_limit_s=cpu_limit_s,
        wall_limit_s=timeout_s,
    )


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the session we started: the launcher and its children
    except ProcessLookupError:
        pass
