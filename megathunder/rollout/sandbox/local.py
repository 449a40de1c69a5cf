"""The local sandbox: one process tree per command, in Linux namespaces, as an unprivileged uid.

Isolation, strongest first (``sandbox.isolation``):

- ``bwrap`` (bubblewrap, Debian package ``bubblewrap``): a new user, mount, pid, network, ipc,
  uts and cgroup namespace. The sandbox sees only read-only system directories (``/usr``,
  ``/bin``, ``/lib*``, ``/sbin``, ``/etc`` plus ``extra_ro_paths``), its work dir read-write at
  ``/workspace``, a private ``/tmp`` of ``tmpfs_mb``, a minimal ``/dev`` and its own ``/proc``.
  No network device besides a down loopback. Every process dies with the sandbox's pid 1 (a
  shell that runs the command as its child).
- ``unshare`` (util-linux): new mount, pid, network, ipc and uts namespaces; every mount is
  remounted read-only except the work dir, then privileges are dropped with ``setpriv``. The host
  filesystem stays visible (read-only; ``/tmp`` too: ``TMPDIR`` is a private ``/dev/shm`` tmpfs of
  ``tmpfs_mb``); use it where bubblewrap is not installed.

Both run the command as a uid of its own (``uid_base + slot``, no supplementary groups, no
capabilities), so ``RLIMIT_NPROC`` counts only that sandbox's processes (root ignores it), and set
``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE`` and ``RLIMIT_NPROC`` before exec. Where cgroups
are writable (``sandbox.cgroup``), each sandbox also gets its own cgroup bounding the memory and
process count of its whole tree (see ``cgroups.py``). The wall-time limit kills the whole process
group; the pid namespace takes every descendant with it.

**Rootless** (this process is not root, e.g. a Slurm user): the same namespaces, made through an
unprivileged user namespace (``unshare -U`` must be allowed: ``kernel.unprivileged_userns_clone``
/ ``user.max_user_namespaces``), and the command runs as this process's own uid (no uid of its
own: only root can switch uids). What changes:

- ``bwrap`` creates the user namespace itself (``--unshare-all`` as an ordinary user); the
  sandbox sees exactly what it sees as root: the read-only system directories, its work dir,
  its own ``/tmp``, ``/proc`` and ``/dev``; no capabilities, ``no_new_privs``.
- ``unshare`` adds ``--user --map-root-user``: root inside (mapped to this uid outside) for the
  mounts, then ``setpriv`` clears every capability (inheritable, bounding) and sets
  ``no_new_privs``; it cannot switch uid (only one is mapped). Since the host tree stays visible
  read-only and every sandbox has the same uid, the sandbox root (``root_dir``: the other
  episodes' work dirs) is first covered by an empty tmpfs and the work dir bound back onto it.
- ``RLIMIT_NPROC`` is set inside the new user namespace (``prlimit``), where the kernel counts
  processes per (user namespace, uid) (Linux >= 5.14): each command's own tree, not the user's
  other processes. CPU, address space, file size and core rlimits are set as under root.
- No cgroup (the cgroup tree is not writable by an ordinary user): ``sandbox.cgroup=auto``
  falls back to rlimits, ``required`` fails.
- Work dirs live under ``<root_dir>-<uid>`` (a directory of the user's own, mode 0700), so that
  a ``root_dir`` made by a root run does not block an ordinary user.

**A task's environment** (``core.Environment``): the local sandbox has no images, so it provides
only what it can lay out -- the files a task's Dockerfile copies into its work directory (the
loader's ``LocalLayout``; the host's system directories stand for the image's). Under bwrap the
work dir is mounted at the task's own path (its WORKDIR, e.g. ``/app``) and the harness's scratch
directories (``/tests``, ``/logs``) are writable directories of the episode, so the task's test
scripts run unchanged. Anything else -- a ``RUN`` step, a file copied elsewhere, a compose file, a
prebuilt image, a network the task's harness gives it (unless ``sandbox.network=none``), another
path under ``unshare`` isolation -- is refused with a ``SandboxError`` naming the task and what it
needs: a task never runs without its environment.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import resource
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Sequence

from megathunder.config import LocalSandboxConfig
from megathunder.rollout.sandbox.cgroups import create_cgroup
from megathunder.rollout.sandbox.core import CommandLimits, Environment, ExecResult, Sandbox, SandboxError, run_process

_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/etc")
_SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CONTAINED_WORKDIR = "/workspace"
# An edit within the same second that keeps a module's size would otherwise be hidden by the stale
# .pyc of the previous test run (its mtime+size check passes): the model would see its fix fail.
_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}


class _UidPool:
    """Distinct unprivileged uids for concurrently open sandboxes of this process.

    The scan starts at an offset derived from the pid, so that several processes sharing a
    ``uid_base`` (e.g. rollout workers on one node) rarely share a uid's process count.
    """

    def __init__(self) -> None:
        self._used: set[int] = set()

    def take(self, base: int, size: int) -> int:
        offset = (os.getpid() * 7919) % size
        for k in range(size):
            uid = base + (offset + k) % size
            if uid not in self._used:
                self._used.add(uid)
                return uid
        raise SandboxError(
            f"all {size} sandbox uids from {base} are in use; raise sandbox.num_uids "
            "(it must cover agent.max_concurrent_episodes)"
        )

    def give(self, uid: int) -> None:
        self._used.discard(uid)


_UIDS = _UidPool()


@functools.cache
def _user_namespaces_error() -> str | None:
    """Why this (non-root) process cannot make a user namespace, or None; checked once."""
    try:
        proc = subprocess.run(["unshare", "--user", "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"exit {proc.returncode}")


def _check_traversable(path: str) -> None:
    """bwrap runs as the sandbox uid, so every directory above the work dir must let it pass."""
    path = os.path.abspath(path)
    while True:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            raise SandboxError(
                f"sandbox.root_dir: {path} is not traversable by other users (mode "
                f"{stat.S_IMODE(os.stat(path).st_mode):04o}); the sandbox uid must reach its work "
                "dir: choose a root_dir below a world-traversable directory such as /tmp"
            )
        if path == "/":
            return
        path = os.path.dirname(path)


def refusal(cfg: LocalSandboxConfig, env: Environment | None) -> str | None:
    """Why the local sandbox cannot provide ``env`` (None: it can)."""
    if env is None:
        return None
    if env.local is None:
        return "it runs in its own image, which the local sandbox does not have"
    if env.local.refusal:
        return env.local.refusal
    if env.network and cfg.network == "task":
        return ("its harness gives it a network, which the local sandbox has not (sandbox.network=none runs "
                "it without one)")
    if cfg.isolation != "bwrap" and (env.local.workdir or env.scratch_dirs):
        where = ", ".join(p for p in (env.local.workdir, *env.scratch_dirs) if p)
        return f"its paths ({where}) can be made only under sandbox.isolation=bwrap"
    return None


class LocalSandbox(Sandbox):
    """One episode's work dir and limits; ``environment``: the task's, when it needs one (see the
    module docstring: what the local sandbox cannot provide is refused, naming the task)."""

    def __init__(self, cfg: LocalSandboxConfig, environment: Environment | None = None) -> None:
        if (why := refusal(cfg, environment)) is not None:
            assert environment is not None
            raise SandboxError(f"task {environment.name}: the local sandbox cannot provide its environment: "
                               f"{why}; run it on backend docker or podman")
        self.cfg = cfg
        self.rootless = os.geteuid() != 0
        tool = "bwrap" if cfg.isolation == "bwrap" else "unshare"
        if shutil.which(tool) is None:
            pkg = "bubblewrap" if tool == "bwrap" else "util-linux"
            raise SandboxError(
                f"sandbox.isolation={cfg.isolation} needs {tool!r} on PATH "
                f"(apt-get install -y {pkg})"
            )
        if self.rootless:
            if (why := _user_namespaces_error()) is not None:
                raise SandboxError(
                    "the local sandbox as an ordinary user needs unprivileged user namespaces "
                    f"(`unshare --user true` fails: {why}; see sysctl user.max_user_namespaces / "
                    "kernel.unprivileged_userns_clone), or run it as root"
                )
            self.root_dir = f"{cfg.root_dir.rstrip('/')}-{os.getuid()}"
            os.makedirs(self.root_dir, mode=0o700, exist_ok=True)
            if os.stat(self.root_dir).st_uid != os.getuid():
                raise SandboxError(
                    f"sandbox.root_dir: {self.root_dir} (the rootless work-dir root) belongs to "
                    f"uid {os.stat(self.root_dir).st_uid}, not to this user ({os.getuid()})"
                )
        else:
            self.root_dir = cfg.root_dir
            os.makedirs(cfg.root_dir, mode=0o711, exist_ok=True)
            os.chmod(cfg.root_dir, 0o711)  # traversable by the sandbox uids, not listable
            if cfg.isolation == "bwrap":
                _check_traversable(cfg.root_dir)
        self.memory_mb = (environment.memory_mb if environment else None) or cfg.memory_mb  # the task's, else ours
        self.cgroup = create_cgroup(cfg.cgroup, self.memory_mb << 20, cfg.max_processes)
        self.uid = os.getuid() if self.rootless else _UIDS.take(cfg.uid_base, cfg.num_uids)
        # the uid the commands see: root of their own user namespace under rootless unshare
        self.contained_uid = 0 if self.rootless and cfg.isolation == "unshare" else self.uid
        self.host_dir = tempfile.mkdtemp(prefix="ep-", dir=self.root_dir)
        self._scratch: dict[str, str] = {}  # absolute path in the sandbox -> host dir (bwrap)
        if environment is not None:
            for k, path in enumerate(environment.scratch_dirs):
                self._scratch[path] = tempfile.mkdtemp(prefix=f"scratch{k}-", dir=self.root_dir)
        for d in (self.host_dir, *self._scratch.values()):
            if not self.rootless:
                os.chown(d, self.uid, self.uid)
        task_dir = environment.local.workdir if environment is not None and environment.local else None
        self.contained_workdir = task_dir or CONTAINED_WORKDIR
        self.workdir = self.contained_workdir if cfg.isolation == "bwrap" else self.host_dir
        self.tmp_dir = self.workdir  # each command gets a /tmp of its own: files that outlive one go here
        self._closed = False

    def _enter(self, own: CommandLimits | None = None) -> None:
        """In the child between fork and exec: join the cgroup, set the rlimits (the agent's, or a
        test run's ``own``), and (root, bwrap) become the sandbox uid; unshare needs root for its
        mounts and drops it itself. Rootless, RLIMIT_NPROC is left to the command's own user
        namespace (``_nproc``)."""
        cfg = self.cfg
        if self.cgroup is not None:
            self.cgroup.join()
        cpu_s = cfg.cpu_time_s if own is None else own.cpu_time_s
        memory_mb = cfg.memory_mb if own is None else own.memory_mb
        limits = [
            (resource.RLIMIT_FSIZE, (cfg.max_file_size_mb << 20,) * 2),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        if cpu_s is not None:
            cpu = max(1, int(cpu_s + 0.999))
            limits.append((resource.RLIMIT_CPU, (cpu, cpu + 1)))  # SIGXCPU at the soft limit, SIGKILL at hard
        if memory_mb is not None:
            limits.append((resource.RLIMIT_AS, (memory_mb << 20,) * 2))
        if not self.rootless:
            limits.append((resource.RLIMIT_NPROC, (self._max_processes(own),) * 2))
        for res, value in limits:
            resource.setrlimit(res, value)
        if cfg.isolation == "bwrap" and not self.rootless:
            os.setgroups([])
            os.setresgid(self.uid, self.uid, self.uid)
            os.setresuid(self.uid, self.uid, self.uid)

    def _max_processes(self, own: CommandLimits | None) -> int:
        return (own.max_processes if own is not None else None) or self.cfg.max_processes

    def _nproc(self, own: CommandLimits | None = None) -> list[str]:
        """Rootless: the process limit, set inside the command's user namespace."""
        n = self._max_processes(own)
        return ["prlimit", f"--nproc={n}:{n}", "--"] if self.rootless else []

    def _bwrap_argv(self, argv: Sequence[str], own: CommandLimits | None = None) -> list[str]:
        cmd = [
            "bwrap",
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--as-pid-1",
        ]
        for path in (*_SYSTEM_DIRS, *self.cfg.extra_ro_paths):
            if os.path.exists(path):
                cmd += ["--ro-bind", path, path]
        cmd += ["--dev", "/dev", "--proc", "/proc"]
        cmd += ["--size", str(self.cfg.tmpfs_mb << 20), "--tmpfs", "/tmp"]
        for path, host in self._scratch.items():
            cmd += ["--bind", host, path]
        cmd += ["--bind", self.host_dir, self.contained_workdir, "--chdir", self.contained_workdir]
        env = {
            "PATH": _SANDBOX_PATH,
            "HOME": self.contained_workdir,
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            **_ENV,
        }
        for key, value in env.items():
            cmd += ["--setenv", key, value]
        # pid 1 is a shell that runs the command as its child: a signal (SIGXCPU) reaches the
        # command (an init ignores it) and comes back as 128 + signal. Without bwrap's own reaper
        # process there is no orphaned launcher left for the host's init to reap: a zombie of the
        # sandbox uid would count against the next sandbox's process limit.
        return cmd + ["--", "sh", "-c", '"$@"; exit $?', "sh", *self._nproc(own), *argv]

    def _unshare_argv(self, argv: Sequence[str], own: CommandLimits | None = None) -> list[str]:
        # As root in fresh namespaces: make the work dir its own mount, remount every other mount
        # read-only, then drop to the sandbox uid with no capabilities and run the command.
        # Rootless: root of a new user namespace; first hide the other work dirs (an empty tmpfs
        # over the sandbox root, the work dir bound back through an open descriptor), and keep
        # the (only mapped) uid when dropping the capabilities.
        hide = (
            'exec 3<"$W"; mount -t tmpfs -o size=1m,mode=0711 tmpfs "$R"; mkdir "$W"; '
            'mount --no-canonicalize --bind /proc/self/fd/3 "$W"; exec 3<&-; '
            if self.rootless
            else 'mount --bind "$W" "$W"; '
        )
        switch = "" if self.rootless else '--reuid="$U" --regid="$U" --clear-groups '
        prelude = (
            'set -e; W="$1"; U="$2"; R="$3"; shift 3; ' + hide +
            "for m in $(awk '{print $2}' /proc/self/mounts); do "
            '[ "$m" = "$W" ] || mount -o remount,bind,ro "$m" 2>/dev/null || true; done; '
            f"mount -t tmpfs -o size={self.cfg.tmpfs_mb}m,mode=1777 tmpfs /dev/shm; "
            'cd "$W"; setpriv ' + switch + "--inh-caps=-all "
            "--bounding-set=-all --no-new-privs -- env -i PATH=" + _SANDBOX_PATH + ' HOME="$W" '
            'TMPDIR=/dev/shm LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 "$@"; exit $?'
        )  # not exec: pid 1 stays this shell, which reports a signal death as 128 + signal
        user = ["--user", "--map-root-user"] if self.rootless else []
        return [
            "unshare", *user, "--mount", "--pid", "--net", "--ipc", "--uts", "--fork",
            "--kill-child", "--mount-proc", "--", "sh", "-c", prelude, "sh", self.host_dir,
            str(self.uid), self.root_dir, *self._nproc(own), *argv,
        ]  # fmt: skip

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        max_output_bytes: int | None = None,
        limits: CommandLimits | None = None,
    ) -> ExecResult:
        if self._closed:
            raise SandboxError("sandbox is closed")
        # bwrap runs as the sandbox uid (in a user namespace); unshare as root, then setpriv.
        bwrap = self.cfg.isolation == "bwrap"
        full = self._bwrap_argv(argv, limits) if bwrap else self._unshare_argv(argv, limits)
        ooms = self.cgroup.oom_kills() if self.cgroup else 0
        result = await run_process(
            full,
            stdin=stdin,
            timeout_s=limits.wall_time_s if limits is not None else timeout_s or self.cfg.wall_time_s,
            max_output_bytes=max_output_bytes or (limits.max_output_bytes if limits else None)
            or self.cfg.max_output_bytes,
            cpu_limit_s=limits.cpu_time_s if limits is not None else self.cfg.cpu_time_s,
            preexec_fn=functools.partial(self._enter, limits),
            cwd="/",
            env=_launcher_env(),
        )
        if self.cgroup and self.cgroup.oom_kills() > ooms:
            result = dataclasses.replace(result, oom_killed=True, memory_limit_mb=self.memory_mb)
        return result

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for d in (self.host_dir, *self._scratch.values()):
            shutil.rmtree(d, ignore_errors=True)
        if self.cgroup is not None:
            self.cgroup.remove()
        if not self.rootless:
            _UIDS.give(self.uid)


def _launcher_env() -> dict[str, str]:
    """The environment of the launcher (bwrap / unshare and its shell), not of the sandboxed
    command, which starts from an empty one. Nothing of the host's is passed on: no secrets, and
    no loader settings such as an ``LD_PRELOAD`` of a host library (vLLM's CPU build sets one for
    its process) that the launcher's shell inside the namespaces cannot open."""
    return {"PATH": os.environ.get("PATH", _SANDBOX_PATH), "LANG": "C.UTF-8"}
