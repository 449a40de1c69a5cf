"""Rank bootstrap from fake launch environments: torchrun, srun steps, batch scripts, nothing."""

from __future__ import annotations

import pytest

from megathunder.learner import rendezvous
from megathunder.learner.rendezvous import (
    LaunchError,
    Rendezvous,
    check_world,
    derived_port,
    expand_hostlist,
    rendezvous_from_env,
)

# What srun sets for task 1 of `srun --nodes=2 --ntasks=2` in job 7 (taken from the local cluster).
SRUN_TASK1 = {
    "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_STEP_NODELIST": "node[1-2]", "SLURMD_NODENAME": "node2", "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1",
}
# ...and what the batch script itself sees (no step, SLURM_PROCID=0 all the same).
BATCH = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[1-2]",
         "SLURMD_NODENAME": "node1", "SLURM_LOCALID": "0"}


def addr_of(name: str) -> str:
    return {"node1": "127.0.0.1", "gpu017": "10.0.3.17", "node3": "10.1.0.3"}[name]


@pytest.mark.parametrize("expr,hosts", [
    ("node1", ["node1"]),
    ("node[1-2]", ["node1", "node2"]),
    ("gpu[001-003,017],login", ["gpu001", "gpu002", "gpu003", "gpu017", "login"]),
    ("a[9-11]", ["a9", "a10", "a11"]),
    ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
    ("node[3,1],x", ["node3", "node1", "x"]),
])
def test_expand_hostlist(expr, hosts):
    assert expand_hostlist(expr) == hosts


def test_srun_task_meets_on_the_first_node_of_the_step():
    r = rendezvous_from_env(SRUN_TASK1, resolve=addr_of)
    assert (r.rank, r.world_size, r.local_rank, r.source, r.node) == (1, 2, 0, "slurm", "node2")
    assert r.master_addr == "127.0.0.1"  # node1's NodeAddr: node names need not resolve
    assert r.master_port == derived_port(7, 0)
    assert "job 7 step 0" in r.describe() and "node2" in r.describe()


def test_step_on_a_subset_of_the_job_uses_the_steps_first_node():
    env = dict(SRUN_TASK1, SLURM_JOB_NODELIST="gpu[016-017],node3", SLURM_STEP_NODELIST="gpu017,node3",
               SLURM_STEP_ID="2", SLURMD_NODENAME="node3")
    r = rendezvous_from_env(env, resolve=addr_of)
    assert r.master_addr == "10.0.3.17"
    assert r.master_port == derived_port(7, 2) != derived_port(7, 0)


def test_exported_master_wins_and_rank0_placement_is_checked():
    env = dict(SRUN_TASK1, MASTER_ADDR="10.9.9.9", MASTER_PORT="4242")
    r = rendezvous_from_env(env, resolve=addr_of)
    assert (r.master_addr, r.master_port) == ("10.9.9.9", 4242)
    wrong = dict(SRUN_TASK1, SLURM_PROCID="0", SLURMD_NODENAME="node2")
    with pytest.raises(LaunchError, match="task 0 runs on node2, not on the step's first node node1"):
        rendezvous_from_env(wrong, resolve=addr_of)


def test_ports_differ_across_jobs_and_stay_out_of_the_ephemeral_range():
    ports = {derived_port(j, s) for j in range(1000, 1100) for s in range(4)}
    assert len(ports) == 400
    assert all(10000 <= p < 32768 for p in ports)


def test_batch_script_without_srun_is_an_error_not_a_singleton():
    with pytest.raises(LaunchError, match="SLURM_NTASKS=2 but outside srun"):
        rendezvous_from_env(BATCH, resolve=addr_of)
    single = rendezvous_from_env(dict(BATCH, SLURM_NTASKS="1"), resolve=addr_of)
    assert (single.rank, single.world_size, single.source) == (0, 1, "single")


def test_torchrun_environment_and_torchrun_singletons_under_srun():
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "5",
                "TORCHELASTIC_RUN_ID": "x"}
    r = rendezvous_from_env(torchrun)
    assert (r.rank, r.world_size, r.local_rank, r.master_addr, r.master_port, r.source) == (
        3, 4, 1, "h0", 5, "torchrun")
    # one torchrun per node under a 2-task step, 2 processes each: a 4-rank world is fine...
    assert rendezvous_from_env({**SRUN_TASK1, **torchrun}).world_size == 4
    # ...but each srun task starting its own 1-process torchrun world is a silent singleton
    with pytest.raises(LaunchError, match="torchrun world size 1 under a Slurm step of 2 tasks"):
        rendezvous_from_env({**SRUN_TASK1, **torchrun, "RANK": "0", "WORLD_SIZE": "1"})


def test_no_launcher_is_a_single_process():
    r = rendezvous_from_env({})
    assert (r.rank, r.world_size, r.local_rank, r.master_addr, r.master_port) == (0, 1, 0, "127.0.0.1", 29500)


def test_bad_integer_names_the_variable():
    with pytest.raises(LaunchError, match="SLURM_PROCID='x'"):
        rendezvous_from_env(dict(SRUN_TASK1, SLURM_PROCID="x"), resolve=addr_of)


def test_world_mismatch_is_loud():
    r = rendezvous_from_env(SRUN_TASK1, resolve=addr_of)
    check_world(r, 1, 2)
    with pytest.raises(LaunchError, match="sees rank 0 of 1, but the launch environment .*slurm job 7.* "
                                          "says rank 1 of 2"):
        check_world(r, 0, 1)


def _rdzv(addr: str, world: int = 2) -> Rendezvous:
    return Rendezvous(0, world, 0, addr, 1234, "slurm", "node1")


def test_export_pins_gloo_to_loopback_only_where_needed(monkeypatch):
    monkeypatch.setattr(rendezvous.socket, "gethostname", lambda: "vm")
    resolved = {"vm": None}
    monkeypatch.setattr(rendezvous, "_resolves_to_loopback", lambda h: resolved.get(h, False))
    env: dict[str, str] = {}
    rendezvous.export(_rdzv("127.0.0.1"), env)  # host name does not resolve, rank 0 on loopback
    assert env == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "GLOO_SOCKET_IFNAME": "lo"}
    resolved["vm"] = True  # resolves to loopback: gloo finds lo by itself
    env = {}
    rendezvous.export(_rdzv("127.0.0.1"), env)
    assert "GLOO_SOCKET_IFNAME" not in env
    env = {"GLOO_SOCKET_IFNAME": "ib0"}  # an explicit choice is kept
    rendezvous.export(_rdzv("127.0.0.1"), env)
    assert env["GLOO_SOCKET_IFNAME"] == "ib0"
    resolved["vm"] = None  # multi-node with an unresolvable host name: say what to set
    with pytest.raises(LaunchError, match="set GLOO_SOCKET_IFNAME"):
        rendezvous.export(_rdzv("10.0.0.1"), {})
    env = {}
    rendezvous.export(_rdzv("10.0.0.1"), env, backend="nccl")
    assert env == {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
