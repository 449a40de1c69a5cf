"""`megathunder sweep` submits a 2-point grid (sync vs thunder, DP=2) to the local cluster through the
real launch script, follows the jobs and tabulates what each run measured."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import pytest

from tests.cluster.conftest import REPO

GRID = REPO / "tests/cluster/sweep_cpu.yaml"


@pytest.mark.slow  # two full jobs; tests/cluster/test_launch.py runs the same launch script on the cluster
def test_a_two_point_grid_runs_and_produces_the_table(slurm_cluster, tmp_path):
    env = dict(slurm_cluster.client_env(), MT_PYTHON=sys.executable, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "megathunder.cli", "sweep", str(GRID), "--out", str(tmp_path), "--timeout-s", "400",
                           "--poll-s", "1"], env=env, cwd=REPO, capture_output=True, text=True, timeout=450)
    print(proc.stdout, proc.stderr)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in (tmp_path / "logs").glob("*.out"))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs}"
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert [(r["run"], r["schedule"], r["state"]) for r in rows] == [
        ("tiny-dp2-sync", "sync", "COMPLETED"), ("tiny-dp2-thunder", "thunder", "COMPLETED")], rows
    jobs = json.loads((tmp_path / "jobs.json").read_text())
    assert len({j["job_id"] for j in jobs.values()}) == 2
    for row in rows:
        assert int(row["steps"]) == 3 and int(row["gpus"]) == 2
        assert float(row["mean_step_s"]) > 0 and float(row["trained_tokens_per_s"]) > 0
        assert int(row["params"]) > 100_000  # the tiny Qwen2 (0.44M), read from final_model
        assert row["mfu"] == ""  # CPU: no peak FLOP/s given
        # each run trained with the schedule of its point (its resolved config says so)
        config = (tmp_path / "runs" / row["run"] / "config.yaml").read_text()
        assert f"mode: {row['schedule']}" in config
    md = (tmp_path / "sweep.md").read_text()
    assert md.startswith("| run | model | layout | schedule | job_id | state | steps |") and "| n/a |" in md
    assert (tmp_path / "sweep.png").stat().st_size > 5000
    # singleton dependency: the second job started when the first had ended (one run at a time)
    times = {}
    for name, job in jobs.items():
        info = slurm_cluster.run_client("scontrol", "show", "job", "-o", str(job["job_id"]), check=False).stdout
        times[name] = dict(re.findall(r"\b(StartTime|EndTime)=(\S+)", info))
    assert times["tiny-dp2-thunder"]["StartTime"] >= times["tiny-dp2-sync"]["EndTime"], times


def test_collect_rebuilds_the_table_and_marks_missing_runs(tmp_path):
    """--collect without any run: the table lists every grid point, not completed, and exits 1."""
    proc = subprocess.run([sys.executable, "-m", "megathunder.cli", "sweep", str(GRID), "--out", str(tmp_path), "--collect"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert [r["run"] for r in rows] == ["tiny-dp2-sync", "tiny-dp2-thunder"]
    assert all(r["steps"] == "" and r["trained_tokens_per_s"] == "" for r in rows)
    assert "not completed: tiny-dp2-sync, tiny-dp2-thunder" in proc.stderr
