"""``megathunder bench chaos``: an attempt past its time limit leaves no process behind -- neither
in its process group nor one that left it for a session of its own (as a supervised run's child)."""

from __future__ import annotations

import os
import sys
import time

from megathunder.bench import chaos_soak

# The parent starts a child in its own group and a grandchild in a new session, prints their pids,
# and sleeps; the run's tag reaches both through the environment.
SCRIPT = """
import os, subprocess, sys, time
same = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
away = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(same.pid, away.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_an_attempt_past_its_limit_is_killed_with_everything_it_started():
    tag = f"test-{os.getpid()}-{time.monotonic_ns()}"
    start = time.monotonic()
    proc = chaos_soak._run_bounded([sys.executable, "-c", SCRIPT], tag, timeout_s=5)
    assert proc.returncode == -9 and "timed out after 5 s" in proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2, proc.stdout
    deadline = time.monotonic() + 30  # SIGKILLed processes are reaped by init: bounded wait
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), pids
    assert not chaos_soak._tagged_processes(tag, sandbox_uids=False)
    assert time.monotonic() - start < 120


def test_an_attempt_within_its_limit_returns_its_output_and_status():
    proc = chaos_soak._run_bounded([sys.executable, "-c", "print('hi'); raise SystemExit(3)"], "t", timeout_s=60)
    assert (proc.returncode, proc.stdout.strip()) == (3, "hi")


def test_sandbox_processes_count_against_a_run_only_when_it_runs_alone(monkeypatch, tmp_path):
    """A run's leak check counts processes of a sandbox uid (they carry no tag) only without runs
    beside it: with ``--parallel 2`` the other run's live sandboxes are not this run's leak (the
    machine-wide check at the soak's end counts them)."""
    import argparse
    import subprocess

    asked = []
    monkeypatch.setattr(chaos_soak, "_train", lambda run, args: subprocess.CompletedProcess([], 0, "", ""))
    monkeypatch.setattr(chaos_soak, "_tagged_processes", lambda tag, sandbox_uids=True: asked.append(sandbox_uids) or [])
    for parallel in (1, 2):
        run = chaos_soak.Run(index=3, kind="none", fault={}, deployment="in_process", out=tmp_path / f"p{parallel}",
                             overrides=[])
        args = argparse.Namespace(parallel=parallel, tag="t", budget_end=float("inf"), max_resumes=3,
                                  shm_root=tmp_path / "shm")
        assert chaos_soak.execute(run, args).outcome == "reference"
    assert asked == [True, False]
