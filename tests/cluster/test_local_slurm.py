"""The local cluster itself: two slurmd nodes, idempotent start, stop by PID, host lists."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megathunder.learner.rendezvous import expand_hostlist
from tests.cluster.conftest import run_job, slurm_local


def test_two_idle_nodes_and_an_idempotent_up(slurm_cluster):
    states = slurm_cluster.node_states()
    assert sorted(states) == ["node1", "node2"], states
    assert all(s in ("idle", "mixed", "allocated", "completing") for s in states.values()), states
    pids = slurm_cluster.pids()
    assert all(pids.values()) and len(set(pids.values())) == 4  # munged, slurmctld, 2 x slurmd
    t0 = time.monotonic()
    slurm_cluster.up()
    assert time.monotonic() - t0 < 5
    assert slurm_cluster.pids() == pids  # nothing restarted


def test_a_two_node_job_runs_one_task_per_node(slurm_cluster, tmp_path):
    body = 'srun --label bash -c \'echo "task $SLURM_PROCID on $SLURMD_NODENAME"\''
    job = run_job(slurm_cluster, tmp_path, body,
                  ("--nodes=2", "--ntasks=2", "--ntasks-per-node=1"))
    assert job.ok(), job.output
    assert sorted(line.split(": ", 1)[1] for line in job.output.splitlines() if ": task" in line) == [
        "task 0 on node1", "task 1 on node2"]


def test_hostlist_expansion_agrees_with_scontrol(slurm_cluster):
    for expr in ("node[1-2]", "gpu[001-003,017],login", "r[1-2]-n[01-02]", "a[9-11]", "x,node[3,1]"):
        out = slurm_cluster.run_client("scontrol", "show", "hostnames", expr).stdout.split()
        assert expand_hostlist(expr) == out, expr


def test_down_stops_exactly_the_daemons_it_started():
    """A second, private one-node cluster: `down` signals its recorded PIDs and nothing else."""
    other = slurm_local.LocalSlurm.from_env(tempfile.mkdtemp(prefix="mt-slurm-"), log=lambda m: None)
    other.num_nodes = 1
    other.up()
    pids = other.pids()
    assert all(pids.values())
    other.down()
    for pid in pids.values():  # gone, or a zombie its parent (this process) has not reaped yet
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    assert not other.is_up() and other.pids() == dict.fromkeys(pids)
    other.down()  # stopping a stopped cluster is a no-op
    shutil.rmtree(other.run_dir)


def test_cli_dry_run_prints_the_config_and_starts_nothing(tmp_path):
    cmd = [sys.executable, slurm_local.__file__, "up", "--dry-run", "--dir", str(tmp_path / "c")]
    out = subprocess.run(cmd,
                         capture_output=True, text=True, check=True).stdout
    assert "NodeName=node1 NodeAddr=127.0.0.1" in out and "NodeName=node2 NodeAddr=127.0.0.2" in out
    assert "slurmd -D -N node2" in out
    assert not (tmp_path / "c").exists()
