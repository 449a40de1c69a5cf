"""Per-sandbox cgroups: one memory limit and one process limit for a sandbox's whole tree.

Rlimits bound each process (``RLIMIT_AS``) and each uid (``RLIMIT_NPROC``); a cgroup bounds the
sum, including a private ``/tmp`` tmpfs the sandbox fills, and tells an out-of-memory kill apart
from other deaths. The group is created below this process's own cgroup (so it nests inside any
limit the host already applies), joined by each command before it execs, and removed on close.

cgroup v1 (separate ``memory`` and ``pids`` hierarchies) and v2 (unified, with the ``memory`` and
``pids`` controllers enabled for children of this process's cgroup) are both handled; where
neither is writable, ``sandbox.cgroup=auto`` falls back to rlimits alone.
"""

from __future__ import annotations

import itertools
import logging
import os

from megathunder.rollout.sandbox.core import SandboxError

log = logging.getLogger(__name__)
_ROOT = "/sys/fs/cgroup"
_counter = itertools.count()
_warned = False


def _own_path(controller: str | None) -> str | None:
    """This process's cgroup path in a v1 hierarchy (``controller``) or in v2 (None)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            if (controller is None and names == "") or controller in names.split(","):
                return path
    return None


class SandboxCgroup:
    def __init__(self, dirs: dict[str, str], version: int) -> None:
        self.dirs, self.version = dirs, version  # controller ("memory", "pids" or "v2") -> dir

    @classmethod
    def create(cls, memory_bytes: int, max_pids: int) -> SandboxCgroup:
        name = f"megathunder-sbx-{os.getpid()}-{next(_counter)}"
        if os.path.isdir(f"{_ROOT}/memory") and os.path.isdir(f"{_ROOT}/pids"):
            dirs = {c: os.path.join(f"{_ROOT}/{c}{_own_path(c)}", name) for c in ("memory", "pids")}
            for d in dirs.values():
                os.mkdir(d)
            _write(f"{dirs['memory']}/memory.limit_in_bytes", memory_bytes)
            if os.path.exists(f"{dirs['memory']}/memory.memsw.limit_in_bytes"):
                _write(f"{dirs['memory']}/memory.memsw.limit_in_bytes", memory_bytes)  # no swap
            _write(f"{dirs['pids']}/pids.max", max_pids)
            return cls(dirs, 1)
        if os.path.exists(f"{_ROOT}/cgroup.controllers"):
            parent = f"{_ROOT}{_own_path(None)}".rstrip("/")
            _write(f"{parent}/cgroup.subtree_control", "+memory +pids")
            d = f"{parent}/{name}"
            os.mkdir(d)
            _write(f"{d}/memory.max", memory_bytes)
            if os.path.exists(f"{d}/memory.swap.max"):
                _write(f"{d}/memory.swap.max", 0)
            _write(f"{d}/pids.max", max_pids)
            return cls({"v2": d}, 2)
        raise SandboxError("no cgroup hierarchy with the memory and pids controllers is mounted")

    def join(self) -> None:
        """Move the calling process (a child between fork and exec, still root) into the group."""
        pid = str(os.getpid())
        for d in self.dirs.values():
            with open(f"{d}/cgroup.procs", "w") as f:
                f.write(pid)

    def oom_kills(self) -> int:
        """Processes of this sandbox the kernel has killed for exceeding the memory limit."""
        if self.version == 1:
            path = f"{self.dirs['memory']}/memory.oom_control"
        else:
            path = f"{self.dirs['v2']}/memory.events"
        try:
            with open(path) as f:
                fields = dict(line.split() for line in f if line.strip())
        except OSError:
            return 0
        return int(fields.get("oom_kill", 0))

    def remove(self) -> None:
        for d in self.dirs.values():
            try:
                os.rmdir(d)
            except OSError as err:  # a process still in it: kill it, then retry once
                try:
                    with open(f"{d}/cgroup.procs") as f:
                        for pid in f.read().split():
                            os.kill(int(pid), 9)
                    os.rmdir(d)
                except OSError:
                    log.warning("could not remove cgroup %s: %s", d, err)


def create_cgroup(mode: str, memory_bytes: int, max_pids: int) -> SandboxCgroup | None:
    """``mode`` is ``sandbox.cgroup``: off, auto (use if possible) or required."""
    if mode == "off":
        return None
    try:
        return SandboxCgroup.create(memory_bytes, max_pids)
    except (OSError, SandboxError) as err:
        if mode == "required":
            raise SandboxError(
                f"sandbox.cgroup=required but no cgroup can be created: {err}"
            ) from err
        global _warned
        if not _warned:
            _warned = True
            log.warning("sandbox: no per-sandbox cgroup (%s); rlimits only", err)
        return None


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


__all__ = ["SandboxCgroup", "create_cgroup"]
