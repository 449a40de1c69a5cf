"""tests/cluster/slurm_local.py without starting anything: its slurm.conf and when it gives up."""

from __future__ import annotations

import pytest

from tests.cluster import slurm_local


def test_slurm_conf_two_nodes_on_loopback_with_distinct_ports(tmp_path):
    cluster = slurm_local.LocalSlurm(tmp_path / "run", num_nodes=2, cpus_per_node=2)
    conf = cluster.slurm_conf(7000, [7001, 7002])
    lines = dict(line.split("=", 1) for line in conf.splitlines()
                 if "=" in line and not line.startswith(("#", "NodeName", "Partition")))
    assert lines["SlurmctldHost"].endswith("(127.0.0.1)") and lines["SlurmctldPort"] == "7000"
    assert lines["AuthInfo"] == f"socket={tmp_path}/run/munge/munge.socket"
    assert lines["SlurmdSpoolDir"].endswith("/spool/%n") and lines["TmpFS"].endswith("/tmp/%n")
    for key, value in [("SlurmdParameters", "config_overrides"), ("SelectType", "select/cons_tres"),
                       ("ProctrackType", "proctrack/linuxproc"), ("TaskPlugin", "task/none"),
                       ("SlurmUser", "root"), ("JobCompType", "jobcomp/filetxt")]:
        assert lines[key] == value, key
    nodes = [line for line in conf.splitlines() if line.startswith("NodeName=")]
    assert [n.split()[0] for n in nodes] == ["NodeName=node1", "NodeName=node2"]
    assert ["NodeAddr=127.0.0.1" in nodes[0], "NodeAddr=127.0.0.2" in nodes[1]] == [True, True]
    assert ["Port=7001" in nodes[0], "Port=7002" in nodes[1]] == [True, True]
    assert all(str(tmp_path) in p for p in (lines["StateSaveLocation"], lines["SlurmctldLogFile"]))


def test_missing_slurm_that_cannot_be_installed_says_why(monkeypatch):
    monkeypatch.setattr(slurm_local, "missing_binaries", lambda: ["slurmctld", "munged"])
    with pytest.raises(slurm_local.SlurmUnavailable,
                       match="missing: slurmctld, munged; MEGATHUNDER_SLURM_NO_INSTALL"):
        slurm_local.ensure_installed(allow_install=False)
    monkeypatch.setattr(slurm_local.os, "geteuid", lambda: 1000)
    with pytest.raises(slurm_local.SlurmUnavailable, match="needs root"):
        slurm_local.ensure_installed()
    monkeypatch.setattr(slurm_local.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm_local.shutil, "which", lambda *a, **k: None)
    with pytest.raises(slurm_local.SlurmUnavailable, match="no apt-get"):
        slurm_local.ensure_installed()


def test_installed_slurm_needs_no_apt(monkeypatch):
    monkeypatch.setattr(slurm_local, "missing_binaries", list)
    monkeypatch.setattr(slurm_local.subprocess, "run", lambda *a, **k: pytest.fail("ran apt-get"))
    slurm_local.ensure_installed()


def test_a_recorded_pid_that_is_not_ours_is_never_signalled(tmp_path):
    """A stale PID file pointing at some other live process (here: this one) is ignored."""
    import os

    cluster = slurm_local.LocalSlurm(tmp_path / "run", log=lambda m: None)
    (cluster.run_dir / "pids").mkdir(parents=True)
    (cluster.run_dir / "pids" / "slurmctld.pid").write_text(f"{os.getpid()}\n")
    assert cluster.pids()["slurmctld"] is None
    assert cluster._stop_recorded(timeout=1) == []


def test_jobs_do_not_inherit_the_submitters_rendezvous(monkeypatch, tmp_path):
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "1",
                       "SLURM_JOB_ID": "99", "TORCHELASTIC_RUN_ID": "x", "KEEP_ME": "1"}.items():
        monkeypatch.setenv(key, value)
    env = slurm_local.LocalSlurm(tmp_path / "run").client_env()
    assert env["KEEP_ME"] == "1" and env["SLURM_CONF"] == str(tmp_path / "run" / "slurm.conf")
    inherited = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"}
    assert not inherited & set(env)
