#!/usr/bin/env python3
"""A real Slurm cluster of two nodes on this one machine, for tests and for trying launch scripts.

    python -m tests.cluster.slurm_local up       # install if missing, start, wait until idle
    python -m tests.cluster.slurm_local env      # print `export SLURM_CONF=...` for a shell
    python -m tests.cluster.slurm_local status   # daemons, their PIDs, `sinfo`
    python -m tests.cluster.slurm_local down     # cancel jobs, stop the daemons by PID
    python -m tests.cluster.slurm_local up --dry-run   # print slurm.conf and the commands only

Environment (all optional):
    MEGATHUNDER_SLURM_DIR        run directory: config, munge key and socket, state, spool, logs,
                                 PID files (default /tmp/megathunder-slurm)
    MEGATHUNDER_SLURM_NODES      number of slurmd nodes, node1..nodeN (default 2)
    MEGATHUNDER_SLURM_CPUS       CPUs each node declares (default: this machine's cores; the
                                 nodes share them)
    MEGATHUNDER_SLURM_NO_INSTALL 1: never run apt-get (fail / skip if Slurm is missing)

Everything lives under the run directory; nothing in /etc is read or written. Each daemon is
started in the foreground (-D / --foreground) in its own session and its PID is recorded from
the spawn, so ``down`` stops exactly the processes ``up`` started (it also checks that each PID's
command line still names this run directory before signalling it). ``up`` is idempotent: if the
daemons recorded in the run directory are alive and ``sinfo`` answers, it returns at once.

Debian 12 ships Slurm 22.05: ``apt-get install slurmctld slurmd slurm-client munge`` (~20-40 s).
Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

APT_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
REQUIRED_BINARIES = ("slurmctld", "slurmd", "sinfo", "sbatch", "srun", "scontrol", "munged")
DEFAULT_DIR = "/tmp/megathunder-slurm"
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
               "GROUP_RANK", "ROLE_RANK")


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed and cannot be installed here (not root, no apt-get, apt failed)."""


class ClusterError(RuntimeError):
    """The cluster did not come up (or down) as expected; the message carries the logs' tails."""


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _sbin_path() -> str:
    """PATH with the sbin directories (daemons live there; a non-login root shell may lack them)."""
    parts = os.environ.get("PATH", "").split(os.pathsep)
    for extra in ("/usr/sbin", "/sbin", "/usr/local/sbin"):
        if extra not in parts:
            parts.append(extra)
    return os.pathsep.join(p for p in parts if p)


def missing_binaries() -> list[str]:
    path = _sbin_path()
    return [b for b in REQUIRED_BINARIES if shutil.which(b, path=path) is None]


def ensure_installed(allow_install: bool = True, log=print) -> None:
    """Install Slurm and munge from the distribution's packages if any binary is missing.

    Raises SlurmUnavailable (with the reason) when they are missing and cannot be installed.
    """
    missing = missing_binaries()
    if not missing:
        return
    reason = f"Slurm binaries missing: {', '.join(missing)}"
    if not allow_install:
        raise SlurmUnavailable(f"{reason}; MEGATHUNDER_SLURM_NO_INSTALL is set")
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"{reason}; installing them needs root (apt-get)")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"{reason}; no apt-get on this machine (install "
                               f"{' '.join(APT_PACKAGES)} with its package manager)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log(f"slurm_local: installing {' '.join(APT_PACKAGES)} with apt-get ...")
    t0 = time.monotonic()
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SlurmUnavailable(f"{reason}; `{' '.join(cmd)}` failed ({proc.returncode}):\n"
                                   f"{(proc.stdout + proc.stderr)[-2000:]}")
    still = missing_binaries()
    if still:
        raise SlurmUnavailable(f"apt-get installed {' '.join(APT_PACKAGES)} but {still} are missing")
    log(f"slurm_local: installed in {time.monotonic() - t0:.0f} s")


@dataclass
class LocalSlurm:
    """One local cluster, identified by its run directory."""

    run_dir: Path
    num_nodes: int = 2
    cpus_per_node: int = field(default_factory=lambda: os.cpu_count() or 2)
    log: object = print

    @classmethod
    def from_env(cls, run_dir: str | os.PathLike | None = None, log=print) -> LocalSlurm:
        return cls(
            run_dir=Path(run_dir or os.environ.get("MEGATHUNDER_SLURM_DIR") or DEFAULT_DIR).resolve(),
            num_nodes=int(os.environ.get("MEGATHUNDER_SLURM_NODES", "2")),
            cpus_per_node=int(os.environ.get("MEGATHUNDER_SLURM_CPUS") or os.cpu_count() or 2),
            log=log,
        )

    # ---- layout ---------------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.run_dir / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.run_dir / "munge" / "munge.socket"

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.num_nodes + 1)]

    def _pid_file(self, name: str) -> Path:
        return self.run_dir / "pids" / f"{name}.pid"

    def _log_file(self, name: str) -> Path:
        return self.run_dir / "log" / f"{name}.log"

    def env(self) -> dict[str, str]:
        """What a client (sinfo, sbatch, srun, scontrol) needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def client_env(self) -> dict[str, str]:
        """This environment without another job's launch variables: SLURM_* of a real cluster's
        job, and a rendezvous (MASTER_ADDR, RANK, ...) an earlier torch.distributed run exported,
        which jobs on this cluster would otherwise inherit."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in LAUNCH_VARS}
        return dict(env, PATH=_sbin_path(), **self.env())

    # ---- configuration --------------------------------------------------------------------
    def slurm_conf(self, ctld_port: int, node_ports: list[int]) -> str:
        d = self.run_dir
        short_host = socket.gethostname().split(".")[0]
        lines = [
            "# Written by tests/cluster/slurm_local.py: a two-node cluster on one machine.",
            "ClusterName=megathunder-local",
            f"SlurmctldHost={short_host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={node_ports[0]}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"TmpFS={d}/tmp/%n",
            f"SlurmctldPidFile={d}/pids/slurmctld.self.pid",
            f"SlurmdPidFile={d}/pids/slurmd-%n.self.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "SlurmdParameters=config_overrides",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={d}/log/jobcomp.txt",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "ReturnToService=2",
            "KillWait=5",
            # ended jobs stay in scontrol for the whole test session: tests read a job's StartTime /
            # EndTime / state after later jobs ran (the sweep's ordering check); at 60 s a first job's
            # record could be purged while a slow second one still ran
            "MinJobAge=3600",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
            "SlurmctldTimeout=60",
        ]
        for i, (name, port) in enumerate(zip(self.node_names, node_ports, strict=True)):
            addr = f"127.0.0.{i + 1}"  # all loopback, but distinct: which node a rendezvous used shows
            lines.append(f"NodeName={name} NodeAddr={addr} NodeHostname={short_host} Port={port} "
                         f"CPUs={self.cpus_per_node} State=UNKNOWN")
        nodes = ",".join(self.node_names)
        lines.append(f"PartitionName=local Nodes={nodes} Default=YES MaxTime=60 State=UP")
        return "\n".join(lines) + "\n"

    def _commands(self) -> dict[str, list[str]]:
        m = self.run_dir / "munge"
        cmds = {"munged": ["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                           f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.self.pid'}",
                           f"--log-file={self._log_file('munged')}", f"--seed-file={m / 'munge.seed'}"],
                "slurmctld": ["slurmctld", "-D", "-i", "-f", str(self.conf)]}
        for name in self.node_names:
            cmds[f"slurmd-{name}"] = ["slurmd", "-D", "-N", name, "-f", str(self.conf)]
        return cmds

    # ---- process bookkeeping --------------------------------------------------------------
    def _read_pid(self, name: str) -> int | None:
        try:
            pid = int(self._pid_file(name).read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if self._is_ours(pid) else None

    def _is_ours(self, pid: int) -> bool:
        """The PID is alive and its command line names this run directory (not a reused PID)."""
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state != "Z" and str(self.run_dir) in cmdline

    def pids(self) -> dict[str, int | None]:
        return {name: self._read_pid(name) for name in self._commands()}

    @contextlib.contextmanager
    def _lock(self):
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / ".lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # ---- queries ---------------------------------------------------------------------------
    def run_client(self, *args: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(args), env=self.client_env(), capture_output=True, text=True,
                              timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise ClusterError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def node_states(self) -> dict[str, str]:
        """{node: state} from sinfo, {} if the controller does not answer."""
        try:
            proc = self.run_client("sinfo", "-h", "-N", "-o", "%N %T", timeout=10, check=False)
        except (subprocess.TimeoutExpired, FileNotFoundError):
            return {}
        if proc.returncode != 0:
            return {}
        states = {}
        for line in proc.stdout.splitlines():
            if line.strip():
                node, state = line.split()
                states[node] = state
        return states

    def is_up(self) -> bool:
        pids = self.pids()
        if not self.conf.exists() or any(pid is None for pid in pids.values()):
            return False
        states = self.node_states()
        return sorted(states) == sorted(self.node_names) and all(
            s in ("idle", "mixed", "allocated", "completing") for s in states.values())

    # ---- start / stop ----------------------------------------------------------------------
    def up(self, timeout: float = 60, allow_install: bool = True) -> LocalSlurm:
        with self._lock():
            if self.is_up():
                self.log(f"slurm_local: already up in {self.run_dir} ({self._summary()})")
                return self
            ensure_installed(allow_install, log=self.log)
            self._stop_recorded()  # a half-started cluster from before: stop what is left of it
            self._write_files()
            t0 = time.monotonic()
            procs = {}
            for name, cmd in self._commands().items():
                if name == "slurmctld":
                    self._wait_for(lambda: self.munge_socket.exists(), 10, "munged socket", procs)
                procs[name] = self._spawn(name, cmd)
            self._wait_for(self._all_idle, timeout, "nodes idle in sinfo", procs)
            self.log(f"slurm_local: up in {time.monotonic() - t0:.1f} s, {self._summary()}; "
                     f"export SLURM_CONF={self.conf}")
            return self

    def _all_idle(self) -> bool:
        states = self.node_states()
        return sorted(states) == sorted(self.node_names) and all(s == "idle" for s in states.values())

    def _summary(self) -> str:
        return ", ".join(f"{name} pid {pid}" for name, pid in self.pids().items())

    def _write_files(self) -> None:
        d = self.run_dir
        for sub in ("state", "log", "pids", "munge", *(f"spool/{n}" for n in self.node_names),
                    *(f"tmp/{n}" for n in self.node_names)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d / "munge", 0o700)
        key = d / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        ports = _free_ports(1 + self.num_nodes)
        self.conf.write_text(self.slurm_conf(ports[0], ports[1:]))

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        with open(self._log_file(f"{name}.stdout"), "ab") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=self.client_env(), start_new_session=True, cwd=self.run_dir)
        self._pid_file(name).write_text(f"{proc.pid}\n")
        return proc

    def _wait_for(self, ready, timeout: float, what: str, procs: dict[str, subprocess.Popen]) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if ready():
                return
            dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                why = (f"{', '.join(f'{n} exited with {rc}' for n, rc in dead.items())}" if dead
                       else f"timed out after {timeout:.0f} s")
                tails = self._log_tails()
                self._stop_recorded()
                raise ClusterError(f"slurm_local: waiting for {what}: {why}\n{tails}")
            time.sleep(0.2)

    def _log_tails(self, lines: int = 15) -> str:
        out = []
        for path in sorted((self.run_dir / "log").glob("*")):
            text = path.read_text(errors="replace").strip().splitlines()[-lines:]
            if text:
                out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)

    def down(self, timeout: float = 20) -> None:
        with self._lock():
            if self._read_pid("slurmctld") is not None:
                self._cancel_jobs()
            stopped = self._stop_recorded(timeout)
            self.log(f"slurm_local: stopped {stopped or 'nothing (not running)'} in {self.run_dir}")

    def _cancel_jobs(self) -> None:
        """Cancel this cluster's jobs so slurmd stops their steps before it goes."""
        with contextlib.suppress(subprocess.TimeoutExpired, ClusterError):
            jobs = self.run_client("squeue", "-h", "-o", "%i", timeout=10).stdout.split()
            if jobs:
                self.run_client("scancel", *jobs, timeout=10, check=False)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and self.run_client(
                        "squeue", "-h", "-o", "%i", timeout=10).stdout.strip():
                    time.sleep(0.3)

    def _stop_recorded(self, timeout: float = 20) -> list[str]:
        """SIGTERM each recorded daemon that is still ours (slurmd first, munged last), then SIGKILL."""
        order = [n for n in self._commands() if n.startswith("slurmd-")] + ["slurmctld", "munged"]
        live = {n: pid for n in order if (pid := self._read_pid(n)) is not None}
        for pid in live.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(self._is_ours(p) for p in live.values()):
            time.sleep(0.1)
        for name, pid in live.items():
            if self._is_ours(pid):
                self.log(f"slurm_local: {name} (pid {pid}) ignored SIGTERM; sending SIGKILL")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for name in order:
            self._pid_file(name).unlink(missing_ok=True)
        return [f"{n} (pid {p})" for n, p in live.items()]

    def dry_run(self) -> str:
        ports = [6817, *range(6818, 6818 + self.num_nodes)]
        cmds = "\n".join(" ".join(c) for c in self._commands().values())
        return (f"# run dir {self.run_dir}; ports are picked free at start (shown: placeholders)\n"
                f"# --- {self.conf}\n{self.slurm_conf(ports[0], ports[1:])}"
                f"# --- daemons, started in this order, each in its own session, PID recorded\n{cmds}\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["up", "down", "status", "env"])
    p.add_argument("--dir", help=f"run directory (default $MEGATHUNDER_SLURM_DIR or {DEFAULT_DIR})")
    p.add_argument("--dry-run", action="store_true", help="print slurm.conf and the commands; start nothing")
    p.add_argument("--timeout", type=float, default=60)
    args = p.parse_args(argv)
    cluster = LocalSlurm.from_env(args.dir, log=lambda msg: print(msg, file=sys.stderr))
    if args.dry_run:
        print(cluster.dry_run(), end="")
        return 0
    try:
        if args.action == "up":
            cluster.up(args.timeout, allow_install=os.environ.get("MEGATHUNDER_SLURM_NO_INSTALL") != "1")
            print(f"export SLURM_CONF={cluster.conf}")
        elif args.action == "down":
            cluster.down()
        elif args.action == "env":
            print(f"export SLURM_CONF={cluster.conf}")
        else:
            up = cluster.is_up()
            print(f"{'up' if up else 'down'}: {cluster.run_dir}")
            for name, pid in cluster.pids().items():
                print(f"  {name}: {pid if pid else '-'}")
            if up:
                print(cluster.run_client("sinfo", "-N", "-l").stdout, end="")
            return 0 if up else 1
    except (SlurmUnavailable, ClusterError) as err:
        print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
