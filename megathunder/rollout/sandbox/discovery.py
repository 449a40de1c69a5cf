"""Where the sandbox servers are: listed in the config, or found from the Slurm job.

``sandbox.server_urls`` wins (the launch scripts pass the servers they started). Empty, the
servers are the nodes of this job's running steps named :data:`STEP_NAME` (``scontrol show step``;
the launch scripts name their sandbox steps so), each at its ``NodeAddr`` and ``sandbox.port`` --
e.g. a user who started ``srun --job-name=sandbox megathunder sandbox serve ...`` by hand in an
allocation, then ``megathunder train`` in the same job.
"""

from __future__ import annotations

import os
import re
import subprocess

from megathunder.config import RemoteSandboxConfig
from megathunder.learner.rendezvous import expand_hostlist, node_address
from megathunder.rollout.sandbox.core import SandboxError

STEP_NAME = "sandbox"


def slurm_step_nodes(job_id: str, step_name: str = STEP_NAME, scontrol: str = "scontrol") -> list[str]:
    """The nodes of job ``job_id``'s steps named ``step_name``, in order, each once."""
    try:
        proc = subprocess.run([scontrol, "show", "step", "-o", job_id], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SandboxError(f"sandbox.server_urls is empty and `scontrol show step` failed: {err}") from None
    if proc.returncode != 0:
        raise SandboxError(f"sandbox.server_urls is empty and `scontrol show step -o {job_id}` failed: "
                           f"{proc.stderr.strip()}")
    nodes: list[str] = []
    for line in proc.stdout.splitlines():
        name = re.search(r"\bName=(\S+)", line)
        where = re.search(r"\bNodeList=(\S+)", line)
        if name and where and name.group(1) == step_name:
            nodes += [n for n in expand_hostlist(where.group(1)) if n not in nodes]
    return nodes


def server_urls(cfg: RemoteSandboxConfig) -> list[str]:
    """The servers of ``cfg``: its list, else those of this Slurm job (:func:`slurm_step_nodes`)."""
    if cfg.server_urls:
        return list(cfg.server_urls)
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        raise SandboxError("sandbox.server_urls is empty and this is not a Slurm job (no SLURM_JOB_ID): "
                           "list the sandbox servers")
    nodes = slurm_step_nodes(job)
    if not nodes:
        raise SandboxError(f"sandbox.server_urls is empty and Slurm job {job} has no running step named "
                           f"{STEP_NAME!r} (start the servers with srun --job-name={STEP_NAME})")
    return [f"http://{node_address(n)}:{cfg.port}" for n in nodes]


__all__ = ["STEP_NAME", "server_urls", "slurm_step_nodes"]
