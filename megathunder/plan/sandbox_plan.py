"""``megathunder plan``: the sandbox servers' CPUs and memory per node (``sandbox.backend: remote``).

Each node that runs a sandbox server holds up to ``sandbox.max_sandboxes_per_server`` sandboxes at
once (the server refuses one more), each bounded by the runtime's limits. Per node, with ``n`` that
bound, the worst case the node must hold is

    memory = n * runtime.memory_mb                 (a container's cgroup; its /tmp, a tmpfs, is charged to it;
                                                    a local sandbox: each tool process's address space)
    CPUs   = n * runtime.cpus / sandbox.cpu_overcommit
                                                   (a local sandbox: one CPU each; an episode's sandbox idles
                                                    while the model generates: overcommit > 1 says so)

beside what else runs there (``reserved``: a rollout node's vLLM servers' host processes). Memory
is never overcommitted: a test suite that reaches its limit at the same time as its neighbours is
the case that matters. A node whose sandboxes do not fit is a problem that names the fields; the
episodes beyond all servers' bound wait for a slot (no problem, a note).
"""

from __future__ import annotations

from dataclasses import dataclass

from megathunder.config import Config, ContainerSandboxConfig, RemoteSandboxConfig

GiB = 1 << 30


@dataclass(frozen=True)
class SandboxNodes:
    """Where the sandbox servers run: ``num_nodes`` nodes of ``cpus`` CPUs and ``memory_gb`` each, of
    which ``reserved_cpus`` / ``reserved_memory_gb`` are taken by what runs beside them."""

    num_nodes: int
    cpus: int
    memory_gb: float
    reserved_cpus: int = 0
    reserved_memory_gb: float = 0.0


@dataclass
class SandboxPlan:
    num_servers: int
    per_server: int  # its bound: sandboxes at once
    cpus: float  # per node, the sandboxes' worst case over the overcommit
    memory: float  # bytes per node
    free_cpus: int
    free_memory: float
    capacity: int  # sandboxes all servers hold at once
    episodes: int  # agent.max_concurrent_episodes
    problems: list[str]

    def lines(self) -> list[str]:
        rows = [f"\nsandbox servers    {self.num_servers} (one per node), up to {self.per_server} sandboxes each: "
                f"{self.capacity} at once for {self.episodes} concurrent episodes"
                + ("" if self.capacity >= self.episodes else " (the rest wait for a slot)"),
                f"  per node CPUs    {self.cpus:.1f} of {self.free_cpus} free",
                f"  per node memory  {self.memory / GiB:.1f} GiB of {self.free_memory / GiB:.1f} GiB free"]
        return rows

    def to_json(self) -> dict:
        return {"num_servers": self.num_servers, "per_server": self.per_server, "cpus_per_node": round(self.cpus, 2),
                "memory_bytes_per_node": round(self.memory), "free_cpus_per_node": self.free_cpus,
                "free_memory_bytes_per_node": round(self.free_memory), "capacity": self.capacity,
                "episodes": self.episodes}


def plan_sandboxes(cfg: Config, nodes: SandboxNodes) -> SandboxPlan | None:
    """The sandbox servers' share of their nodes; None when the sandboxes are not on servers."""
    sb = cfg.sandbox
    if not isinstance(sb, RemoteSandboxConfig):
        return None
    rt, n = sb.runtime, sb.max_sandboxes_per_server
    cpus_each = rt.cpus if isinstance(rt, ContainerSandboxConfig) else 1.0
    cpus = n * cpus_each / sb.cpu_overcommit
    memory = float(n * rt.memory_mb) * (1 << 20)
    free_cpus = nodes.cpus - nodes.reserved_cpus
    free_memory = (nodes.memory_gb - nodes.reserved_memory_gb) * GiB
    problems = []
    if cpus > free_cpus:
        problems.append(f"sandbox.max_sandboxes_per_server: {n} sandboxes x sandbox.runtime.cpus={cpus_each:g} / "
                        f"sandbox.cpu_overcommit={sb.cpu_overcommit:g} = {cpus:.1f} CPUs per node, but a sandbox node "
                        f"has {free_cpus} free ({nodes.cpus} less {nodes.reserved_cpus} reserved)")
    if memory > free_memory:
        problems.append(f"sandbox.max_sandboxes_per_server: {n} sandboxes x sandbox.runtime.memory_mb={rt.memory_mb} = "
                        f"{memory / GiB:.1f} GiB per node, but a sandbox node has {free_memory / GiB:.1f} GiB free "
                        f"({nodes.memory_gb:g} less {nodes.reserved_memory_gb:g} reserved)")
    num_servers = len(sb.server_urls) or nodes.num_nodes
    return SandboxPlan(num_servers, n, cpus, memory, free_cpus, free_memory, num_servers * n,
                       cfg.agent.max_concurrent_episodes, problems)


__all__ = ["SandboxNodes", "SandboxPlan", "plan_sandboxes"]
