"""Submitting the real launch scripts to the local cluster and following them (shared by tests)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.cluster.conftest import REPO, TERMINAL, slurm_local

CPU_CONFIG = REPO / "tests/cluster/grpo_cpu.yaml"
# two local nodes: one rollout node (a vLLM server), one learner node with DP=2 (two ranks)
CPU_LAYOUT = {"MT_GPUS_PER_NODE": "0", "MT_ROLLOUT_NODES": "1", "MT_LEARNER_NODES": "1",
              "MT_LEARNER_TASKS_PER_NODE": "2"}
CPU_SBATCH = ("--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10")


@dataclass
class LaunchedJob:
    job_id: int
    out: Path  # the batch script's output (appended across requeues)
    log_dir: Path  # MT_LOG_DIR: attempt-N/ per (re)start
    seconds: float = 0.0
    state: str = ""
    exit_code: str = ""

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.is_file() else ""

    def logs(self, attempt: int = 0) -> dict[str, str]:
        d = self.log_dir / f"attempt-{attempt}"
        return {p.name: p.read_text(errors="replace") for p in sorted(d.glob("*")) if p.is_file()}

    def describe(self) -> str:
        logs = "\n".join(f"--- {name}\n{text[-3000:]}" for a in (0, 1) for name, text in self.logs(a).items()
                         if name.endswith(".out"))
        return f"job {self.job_id} {self.state} {self.exit_code} after {self.seconds:.0f} s:\n{self.output()}\n{logs}"


HEALTH_TIMEOUT_S = 600
"""How long the launch script waits for the servers' /health (``MT_HEALTH_TIMEOUT_S``): generous,
since a vLLM server on a busy 2-core machine can take minutes to start; a job that fails fast
fails well before it (the tests assert below it: not waited out)."""


def mt_env(cluster, tmp: Path, **extra: str) -> dict[str, str]:
    port = slurm_local._free_ports(1)[0]
    return {**cluster.client_env(), **CPU_LAYOUT, "MT_CONFIG": str(CPU_CONFIG), "MT_PYTHON": sys.executable,
            "MT_SERVER_PORT": str(port), "MT_LOG_DIR": str(tmp / "logs"), "MT_HEALTH_TIMEOUT_S": str(HEALTH_TIMEOUT_S),
            "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def submit(cluster, script: str, env: dict[str, str], out: Path, sbatch_args=CPU_SBATCH) -> LaunchedJob:
    proc = subprocess.run(["sbatch", "--parsable", f"--output={out}", *sbatch_args, str(REPO / script)],
                          env=env, cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return LaunchedJob(int(proc.stdout.strip().split(";")[0]), out, Path(env["MT_LOG_DIR"]))


def job_info(cluster, job: LaunchedJob) -> dict[str, str]:
    info = cluster.run_client("scontrol", "show", "job", "-o", str(job.job_id), check=False).stdout
    return dict(re.findall(r"(\w+)=(\S*)", info))


def wait_for(cluster, job: LaunchedJob, timeout: float, until=lambda info: info.get("JobState") in TERMINAL,
             t0: float | None = None) -> dict[str, str]:
    t0 = time.monotonic() if t0 is None else t0
    while time.monotonic() - t0 < timeout:
        info = job_info(cluster, job)
        job.state, job.exit_code = info.get("JobState", job.state), info.get("ExitCode", "")
        job.seconds = time.monotonic() - t0
        if until(info):
            return info
        time.sleep(0.25)
    cluster.run_client("scancel", str(job.job_id), check=False)
    raise AssertionError(f"timed out after {timeout:.0f} s: {job.describe()}")


