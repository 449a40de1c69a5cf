"""A real two-node Slurm cluster on this machine, up once per test session (``tests/cluster/slurm_local.py``).

MEGATHUNDER_SLURM_DIR=DIR  use the cluster in DIR (started with `python -m tests.cluster.slurm_local up`);
                           it is left running if it was already up. Default: a private cluster in
                           a fresh temp dir, stopped (by PID) at the end of the session.
MEGATHUNDER_REQUIRE_SLURM=1  fail instead of skip when Slurm cannot be installed.

Slurm is installed from Debian packages when missing (root + apt-get); the tests skip, with the
reason, only when that cannot be done.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster import slurm_local

REPO = Path(__file__).resolve().parents[2]

JOB_END = "__megathunder_test_job_end__"
OUTPUT_WAIT_S = 30.0
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}


@pytest.fixture(scope="session")
def slurm_cluster():
    log = lambda msg: print(msg, file=sys.stderr)
    private = not os.environ.get("MEGATHUNDER_SLURM_DIR")
    if private:  # short path: the munge socket path must stay under 108 bytes
        cluster = slurm_local.LocalSlurm.from_env(tempfile.mkdtemp(prefix="mt-slurm-"), log=log)
    else:
        cluster = slurm_local.LocalSlurm.from_env(log=log)
    was_up = cluster.is_up()
    try:
        cluster.up(allow_install=os.environ.get("MEGATHUNDER_SLURM_NO_INSTALL") != "1")
    except slurm_local.SlurmUnavailable as err:
        if os.environ.get("MEGATHUNDER_REQUIRE_SLURM") == "1":
            pytest.fail(f"MEGATHUNDER_REQUIRE_SLURM=1 but {err}")
        pytest.skip(f"no local Slurm cluster: {err}")
    yield cluster
    if not was_up:
        cluster.down()
    if private:
        shutil.rmtree(cluster.run_dir, ignore_errors=True)


@dataclass
class Job:
    job_id: int
    state: str
    exit_code: str  # "code:signal"
    output: str
    seconds: float  # submit to end, as the test saw it

    def ok(self) -> bool:
        return self.state == "COMPLETED" and self.exit_code == "0:0"

    def ranks(self) -> dict[int, dict[int, tuple[str, str]]]:
        """{step: {rank: (node, rendezvous)}} from the line init_distributed prints per rank:
        'megathunder: rank 1/2 (local 0) on node2 (slurm job 3 step 1 on node[1-2]);
        rendezvous 127.0.0.1:10049' (one line)."""
        found: dict[int, dict[int, tuple[str, str]]] = {}
        for m in re.finditer(r"megathunder: rank (\d+)/\d+ \(local \d+\) on (\S+) \(slurm job \d+ step (\d+) "
                             r"on \S+\); rendezvous (\S+)", self.output):
            found.setdefault(int(m.group(3)), {})[int(m.group(1))] = (m.group(2), m.group(4))
        return found


def run_job(cluster, workdir: Path, body: str, sbatch_args: tuple[str, ...] = (),
            timeout: float = 240) -> Job:
    """sbatch a bash script (body after the header), wait for its end, return state and output.

    Polls ``scontrol show job`` every 0.25 s (``sbatch --wait`` polls too slowly for tests). A job
    can reach its final state before the batch step's output file holds everything its steps
    printed, so the script ends by writing a last line (an EXIT trap, after every srun in it has
    returned and with it every line its tasks wrote); the output is read once that line is there.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    script, out = workdir / "job.sh", workdir / "job.out"
    script.write_text("#!/bin/bash\nset -euo pipefail\n"
                      f"trap 'echo {JOB_END}' EXIT\n"
                      f"export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore PY={shlex.quote(sys.executable)}\n"
                      f"cd {shlex.quote(str(REPO))}\n{body}\n")
    t0 = time.monotonic()
    job_id = int(cluster.run_client("sbatch", "--parsable", f"--output={out}", "--time=3", *sbatch_args,
                                    str(script)).stdout.strip().split(";")[0])
    state, exit_code = "PENDING", ""
    while time.monotonic() - t0 < timeout:
        info = cluster.run_client("scontrol", "show", "job", "-o", str(job_id), check=False).stdout
        state = re.search(r"JobState=(\S+)", info).group(1) if "JobState=" in info else state
        if state in TERMINAL:
            exit_code = re.search(r"\bExitCode=(\S+)", info).group(1)
            break
        time.sleep(0.25)
    else:
        cluster.run_client("scancel", str(job_id), check=False)
        pytest.fail(f"job {job_id} still {state} after {timeout:.0f} s:\n{_read(out)}")
    seconds = time.monotonic() - t0
    output = _read(out)
    waited = time.monotonic()
    while JOB_END not in output and time.monotonic() - waited < OUTPUT_WAIT_S:  # killed jobs never write it
        time.sleep(0.1)
        output = _read(out)
    return Job(job_id, state, exit_code, output.replace(f"{JOB_END}\n", ""), seconds)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def worker_cmd(mode: str, *args: str) -> str:
    """The learner worker as a shell command ($PY is this interpreter, exported by run_job)."""
    return '"$PY" ' + shlex.join([str(REPO / "tests/distributed/learner_worker.py"), mode, *args])
