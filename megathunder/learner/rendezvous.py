"""Where this process sits in a distributed job: rank, world size and rank 0's address.

``rendezvous_from_env()`` reads, in this order:

1. **torchrun** (``TORCHELASTIC_RUN_ID``, or ``RANK`` and ``WORLD_SIZE``): everything from its
   environment. Under an srun step, torchrun's world must cover the step's tasks (one torchrun
   per node); a smaller world means every task started its own world -- a silent singleton.
2. **an srun step** (``SLURM_STEP_ID`` set): rank ``SLURM_PROCID``, world ``SLURM_STEP_NUM_TASKS``,
   local rank ``SLURM_LOCALID``. Rank 0's address is ``MASTER_ADDR`` if the launch script
   exported one, else the Slurm address (``NodeAddr``, from ``scontrol show node``) of the first
   node of the *step's* node list -- not the job's: a learner step on the second half of a job's
   nodes must meet on its own first node. Task 0 runs there under block and cyclic distribution;
   rank 0 checks that. ``SLURM_LAUNCH_NODE_IPADDR`` is not used: it is where ``srun`` ran (for an
   interactive ``srun`` a login node that runs no task). The port is ``MASTER_PORT`` if exported,
   else derived from the job and step ids, so concurrent jobs and steps on a node do not collide.
   Node names need not resolve: on the local test cluster ``node1`` is ``NodeAddr=127.0.0.1``.
3. **a Slurm batch script without srun** (``SLURM_JOB_ID`` but no step): with more than one task
   in the job this is an error (it would wait for ranks that were never started, or train alone).
4. **nothing**: a single process.

``check_world`` is called once torch.distributed is up: the world it sees must be the one the
environment promised, so a mis-launched job fails at start, loudly, instead of training alone.
At thousands of ranks the launch script should export ``MASTER_ADDR`` once (one ``scontrol``
call per rank is fine at 128).
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import socket
import subprocess
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

DEFAULT_PORT = 29500
PORT_BASE, PORT_SPAN = 10000, 22000  # derived ports stay below Linux's ephemeral range (32768+)


class LaunchError(RuntimeError):
    """The process was launched in a way that cannot form the intended world; says how to fix it."""


@dataclass(frozen=True)
class Rendezvous:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm", "single"
    node: str  # the node this process runs on (SLURMD_NODENAME, else the hostname)
    where: str = ""  # e.g. "slurm job 7 step 0 on node[1-2]"

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} (local {self.local_rank}) on {self.node}"
                f"{' (' + self.where + ')' if self.where else ''}; "
                f"rendezvous {self.master_addr}:{self.master_port} [{self.source}]")


# ---- Slurm host lists -------------------------------------------------------------------------
def _split_top_level(expr: str) -> list[str]:
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    parts.append(expr[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range(body: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo) if lo.startswith("0") else 0  # zero padding: gpu[01-16]
            out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
        else:
            out.append(item)
    return out


def expand_hostlist(expr: str) -> list[str]:
    """Slurm's compressed host list -> names, as ``scontrol show hostnames`` gives them.

    ``node[1-2]`` -> node1 node2; ``gpu[01-03,07],login`` -> gpu01 gpu02 gpu03 gpu07 login;
    ``r[1-2]-n[1-2]`` -> r1-n1 r1-n2 r2-n1 r2-n2.
    """
    hosts: list[str] = []
    for part in _split_top_level(expr):
        pieces = re.split(r"(\[[^\]]*\])", part)
        choices = [_expand_range(p[1:-1]) if p.startswith("[") else [p] for p in pieces if p]
        if any(not c for c in choices):
            raise LaunchError(f"cannot parse Slurm host list {expr!r}")
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def node_address(name: str, scontrol: str = "scontrol") -> str:
    """The address Slurm uses to reach ``name`` (its NodeAddr); the name itself if scontrol cannot say."""
    try:
        proc = subprocess.run([scontrol, "show", "node", "-o", name], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return name
    match = re.search(r"\bNodeAddr=(\S+)", proc.stdout)
    return match.group(1) if proc.returncode == 0 and match else name


def derived_port(job_id: int, step_id: int) -> int:
    """A port per (job, step): steps of one job and recent jobs on a node get different ports."""
    return PORT_BASE + (job_id * 16 + step_id % 16) % PORT_SPAN


# ---- the environment --------------------------------------------------------------------------
def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except (KeyError, ValueError):
        raise LaunchError(f"{key}={env.get(key)!r}: expected an integer in the launch environment") from None


def rendezvous_from_env(env: Mapping[str, str] | None = None,
                        resolve: Callable[[str], str] = node_address) -> Rendezvous:
    """Rank, world size, local rank and rank 0's address; see the module docstring for the order."""
    env = os.environ if env is None else env
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    in_step = "SLURM_STEP_ID" in env and "SLURM_PROCID" in env
    step_tasks = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1"))) if in_step else 1

    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env):
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        if in_step and (world < step_tasks or world % step_tasks):
            raise LaunchError(
                f"torchrun world size {world} under a Slurm step of {step_tasks} tasks: each srun task "
                f"started its own torchrun world (silent singletons). Run one torchrun per node "
                f"(srun --ntasks-per-node=1) with --nnodes and a shared rendezvous, or drop torchrun "
                f"and let srun start one process per rank.")
        return Rendezvous(rank, world, int(env.get("LOCAL_RANK", 0)), env.get("MASTER_ADDR", "127.0.0.1"),
                          int(env.get("MASTER_PORT", DEFAULT_PORT)), "torchrun", node)

    if in_step:
        job_id, step_id = _int(env, "SLURM_JOB_ID"), _int(env, "SLURM_STEP_ID")
        rank, local_rank = _int(env, "SLURM_PROCID"), int(env.get("SLURM_LOCALID", 0))
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or node
        first = expand_hostlist(nodelist)[0]
        if "MASTER_ADDR" in env:
            addr = env["MASTER_ADDR"]
        else:
            if rank == 0 and env.get("SLURMD_NODENAME", first) != first:
                raise LaunchError(
                    f"task 0 runs on {env['SLURMD_NODENAME']}, not on the step's first node {first} "
                    f"({nodelist}); with this task distribution export MASTER_ADDR to task 0's node")
            addr = resolve(first)
        port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else derived_port(job_id, step_id)
        return Rendezvous(rank, step_tasks, local_rank, addr, port, "slurm", node,
                          f"slurm job {job_id} step {step_id} on {nodelist}")

    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        raise LaunchError(
            f"running in the batch script of Slurm job {env['SLURM_JOB_ID']} with SLURM_NTASKS="
            f"{env['SLURM_NTASKS']} but outside srun: only this one process would start. "
            f"Launch it with `srun` (one process per task).")

    return Rendezvous(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", DEFAULT_PORT)),
                      "single", node)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _resolves_to_loopback(host: str) -> bool | None:
    """True / False, or None when the name does not resolve at all."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return None
    return all(_is_loopback(str(info[4][0])) for info in infos)


def export(rdzv: Rendezvous, env: MutableMapping[str, str] | None = None, backend: str = "gloo") -> None:
    """Set MASTER_ADDR / MASTER_PORT (and, for gloo, GLOO_SOCKET_IFNAME) for init_process_group.

    gloo advertises the address its host name resolves to. When rank 0 is on loopback every rank
    is on this machine, so where the host name does not resolve to loopback we pin gloo to ``lo``.
    A host name that does not resolve on a multi-node job cannot be fixed here: say so.
    """
    env = os.environ if env is None else env
    env["MASTER_ADDR"], env["MASTER_PORT"] = rdzv.master_addr, str(rdzv.master_port)
    if backend != "gloo" or rdzv.world_size == 1 or "GLOO_SOCKET_IFNAME" in env:
        return
    hostname = socket.gethostname()
    loopback = _resolves_to_loopback(hostname)
    if _is_loopback(rdzv.master_addr) or _resolves_to_loopback(rdzv.master_addr):
        if loopback is not True:
            env["GLOO_SOCKET_IFNAME"] = "lo"
    elif loopback is None:
        raise LaunchError(f"host name {hostname!r} does not resolve, so gloo cannot pick the interface "
                          f"to reach rank 0 at {rdzv.master_addr}: set GLOO_SOCKET_IFNAME")


def check_world(rdzv: Rendezvous, rank: int, world_size: int) -> None:
    """After init_process_group: torch.distributed's world must be the launch environment's."""
    if (rank, world_size) != (rdzv.rank, rdzv.world_size):
        raise LaunchError(
            f"torch.distributed sees rank {rank} of {world_size}, but the launch environment "
            f"({rdzv.source}{', ' + rdzv.where if rdzv.where else ''}) says rank {rdzv.rank} of "
            f"{rdzv.world_size}: the processes did not form one world")
