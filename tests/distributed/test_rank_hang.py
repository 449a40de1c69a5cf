"""A learner rank that hangs stops the run within a bound, with one line naming it.

Rank 1 either SIGSTOPs itself (no failure reaches gloo: its sockets stay open, its heartbeat thread
stops) or loops forever inside a call (its heartbeat thread lives). Rank 0's watchdog must name it
and end the process with ``LEARNER_HUNG``; a healthy run whose calls take longer than a beat must
not trip it. Plain processes, no torchrun (whose agent would end the ranks itself).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megathunder.learner.liveness import LEARNER_HUNG, STOPS_RESUMABLY
from tests.distributed.conftest import free_port

WORKER = Path(__file__).with_name("rank_hang_worker.py")
DETECT_MARGIN_S = 60.0  # process start and a loaded 2-core machine; the bounds themselves are a few seconds


def _run(tmp_path: Path, mode: str, heartbeat_timeout_s: float, call_timeout_s: float,
         timeout: float = 180.0) -> tuple[int, str, float | None, float]:
    """(rank 0's exit status, its output, when rank 1 hung (None if it did not), when rank 0 exited)."""
    fault_file = tmp_path / "fault_time"
    port = free_port()
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen(  # a session each: the finally ends the rank and any child of it
                [sys.executable, str(WORKER), mode, str(heartbeat_timeout_s), str(call_timeout_s), str(fault_file)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
        out0, _ = procs[0].communicate(timeout=timeout)
        exited = time.time()
        hung_at = float(fault_file.read_text()) if fault_file.is_file() else None
        return procs[0].returncode, out0, hung_at, exited
    finally:
        for proc in procs:  # a stopped or spinning rank 1 never exits by itself
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # also ends a SIGSTOPped process
            except ProcessLookupError:  # the rank and every process of its group have ended
                pass
            proc.wait(timeout=30)


def _child_ended(out: str) -> bool:
    """Whether rank 0's multiprocessing child (a Manager, as Megatron's checkpoint writer starts)
    is gone; an orphan is reaped by init soon after rank 0 exits (bounded wait)."""
    pid = int(next(line for line in out.splitlines() if line.startswith("CHILD")).split()[1])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)  # not to leave it behind on this machine either
    return False


def _hung_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("megathunder: learner")]
    assert len(lines) == 1, out[-3000:]
    assert lines[0].endswith(STOPS_RESUMABLY), lines[0]
    return lines[0]


@pytest.mark.parametrize("mode", ["sigstop", "hang_learner"])
def test_a_stopped_rank_is_named_by_its_silent_heartbeat(tmp_path, mode):
    """``sigstop``: rank 1 stops itself inside call 3; ``hang_learner``: the chaos fault, sent
    between calls 2 and 3, makes it stop as it receives it."""
    status, out, hung_at, exited = _run(tmp_path, mode, heartbeat_timeout_s=3, call_timeout_s=0)
    assert status == LEARNER_HUNG, out[-3000:]
    line = _hung_line(out)
    assert "learner call 3 ('step')" in line and "rank 1 hung (no heartbeat for" in line, line
    assert "rank 0" not in line, line
    assert hung_at is not None, out[-3000:]
    detected = exited - hung_at
    print(f"{mode}: named {detected:.1f} s after the SIGSTOP (heartbeat bound 3 s): {line}")
    assert detected < 3 + DETECT_MARGIN_S
    assert _child_ended(out), "rank 0's multiprocessing child outlived it"


@pytest.mark.slow  # a dead rank is named by test_rank_loss.py; the fault's message path by hang_learner above
def test_kill_learner_is_found_by_gloo_and_named_by_the_heartbeats(tmp_path):
    status, out, killed_at, exited = _run(tmp_path, "kill_learner", heartbeat_timeout_s=30, call_timeout_s=0)
    assert status == 3, out[-3000:]  # LearnerRankLost, as for any dead rank (test_rank_loss.py)
    line = [line for line in out.splitlines() if line.startswith("megathunder: learner call")]
    assert line and "rank 1 (silent" in line[0] and "rank 0 (silent" not in line[0], out[-3000:]
    assert killed_at is not None, out[-3000:]
    print(f"kill_learner: named {exited - killed_at:.1f} s after the fault was sent: {line[0]}")
    assert exited - killed_at < DETECT_MARGIN_S


def test_a_rank_wedged_in_its_call_is_named_by_the_call_bound(tmp_path):
    status, out, hung_at, exited = _run(tmp_path, "spin", heartbeat_timeout_s=30, call_timeout_s=3)
    assert status == LEARNER_HUNG, out[-3000:]
    line = _hung_line(out)
    assert "rank 1 hung (in call 3 ('step') for" in line and "heartbeat alive" in line, line
    assert "rank 0 hung" not in line, line
    assert hung_at is not None, out[-3000:]
    detected = exited - hung_at
    print(f"spin: named {detected:.1f} s after it wedged (call bound 3 s): {line}")
    assert detected < 3 + DETECT_MARGIN_S
    assert _child_ended(out), "rank 0's multiprocessing child outlived it"


@pytest.mark.parametrize("heartbeat_timeout_s,call_timeout_s", [(10, 10)])
def test_slow_calls_do_not_trip_the_watchdog(tmp_path, heartbeat_timeout_s, call_timeout_s):
    status, out, hung_at, _ = _run(tmp_path, "slow", heartbeat_timeout_s, call_timeout_s)
    assert status == 0 and "FINISHED" in out, out[-3000:]
    assert "hung" not in out and hung_at is None, out[-3000:]
