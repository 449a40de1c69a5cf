"""What a sandbox server owns on its node, recorded so that nothing outlives it.

A server stopped by a signal destroys every sandbox it holds. One killed (SIGKILL, the node's OOM
killer) cannot: its sandboxes' processes die with it (bubblewrap's ``--die-with-parent``; a
container's ``sleep`` keeps running), but their work directories, cgroups and containers stay. So
each server works in places of its own, keyed by its node and port (``<node>-<port>``):

- local runtime: the work directories under ``<runtime.root_dir>/<key>`` (only this server's);
- every runtime: ``<sandbox.state_dir>/<key>/owned.jsonl``, one line per cgroup and container it
  created (appended before the create returns);
- docker / podman: the label ``megathunder.sandbox.server=<key>`` on each container.

A server started at the same node and port (the launch scripts' next attempt) first removes what
the ledger and its work root name -- killing processes still in a recorded cgroup, removing
recorded containers -- then empties the ledger. Nothing is removed that this key did not record:
other servers and runs on the node are untouched.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

from megathunder.config import ContainerSandboxConfig, LocalSandboxConfig
from megathunder.rollout.sandbox.cgroups import SandboxCgroup
from megathunder.rollout.sandbox.container import _RUNTIMES, ContainerSandbox
from megathunder.rollout.sandbox.core import Sandbox
from megathunder.rollout.sandbox.local import LocalSandbox

log = logging.getLogger(__name__)
SERVER_LABEL = "megathunder.sandbox.server"


def work_root(runtime: LocalSandboxConfig) -> str:
    """Where a local sandbox of ``runtime`` makes its work directories (rootless: the user's own)."""
    return runtime.root_dir if os.geteuid() == 0 else f"{runtime.root_dir.rstrip('/')}-{os.getuid()}"


def keyed_runtime(runtime: LocalSandboxConfig | ContainerSandboxConfig, key: str) -> LocalSandboxConfig | ContainerSandboxConfig:
    """The runtime as the server ``key`` runs it: its own work root (local), its label (docker/podman)."""
    if isinstance(runtime, LocalSandboxConfig):
        return runtime.model_copy(update={"root_dir": f"{runtime.root_dir.rstrip('/')}/{key}"})
    if runtime.backend in ("docker", "podman"):
        return runtime.model_copy(update={"extra_args": [*runtime.extra_args, "--label", f"{SERVER_LABEL}={key}"]})
    return runtime


class Ledger:
    """``owned.jsonl`` of one server key, and the sweep of what it names."""

    def __init__(self, state_dir: str, key: str, runtime: LocalSandboxConfig | ContainerSandboxConfig) -> None:
        self.dir = Path(state_dir) / key
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.dir / "owned.jsonl"
        self.runtime = runtime  # as keyed: its root_dir is this server's own

    def record(self, sandbox: Sandbox) -> None:
        """Note what ``sandbox`` holds on the node (before its create is answered)."""
        entry: dict | None = None
        if isinstance(sandbox, LocalSandbox) and sandbox.cgroup is not None:
            entry = {"kind": "cgroup", "dirs": sandbox.cgroup.dirs, "version": sandbox.cgroup.version}
        elif isinstance(sandbox, ContainerSandbox):
            entry = {"kind": "container", "name": sandbox.name}
        if entry is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(entry) + "\n")

    def clear(self) -> None:
        self.path.write_text("")

    def sweep(self) -> list[str]:
        """Remove what a previous server of this key left; returns what was removed, in words."""
        removed: list[str] = []
        lines = self.path.read_text().splitlines() if self.path.is_file() else []
        for line in lines:
            entry = json.loads(line)
            if entry["kind"] == "cgroup":
                dirs = {k: v for k, v in entry["dirs"].items() if os.path.isdir(v)}
                if dirs:
                    SandboxCgroup(dirs, entry["version"]).remove()  # kills what is still in it
                    removed.append(f"cgroup {next(iter(dirs.values()))}")
            elif entry["kind"] == "container" and isinstance(self.runtime, ContainerSandboxConfig):
                argv = _RUNTIMES[self.runtime.backend][2](self.runtime, entry["name"])
                try:
                    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
                except (OSError, subprocess.TimeoutExpired) as err:
                    log.warning("sandbox server: cannot remove container %s: %s", entry["name"], err)
                    continue
                if done.returncode == 0:
                    removed.append(f"container {entry['name']}")
        if isinstance(self.runtime, LocalSandboxConfig):
            root = Path(work_root(self.runtime))
            for child in sorted(root.iterdir()) if root.is_dir() else []:
                shutil.rmtree(child, ignore_errors=True)
                removed.append(f"work dir {child}")
        self.clear()
        return removed


__all__ = ["SERVER_LABEL", "Ledger", "keyed_runtime", "work_root"]
