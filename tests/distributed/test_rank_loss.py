"""Fail fast: a learner rank that dies stops the run within seconds, with a message naming it.

The two ranks are started as plain processes (no torchrun, whose agent would kill rank 0 as soon
as rank 1 exits): what is checked is that the learner itself notices and names the rank.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

WORKER = Path(__file__).with_name("rank_loss_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_learner_rank_is_named_and_stops_the_run():
    port = _free_port()
    procs = []
    start = time.monotonic()
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(WORKER)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    out0, _ = procs[0].communicate(timeout=120)
    procs[1].wait(timeout=30)
    assert procs[1].returncode == 9  # the rank that died
    assert procs[0].returncode == 3, out0[-3000:]
    stopped = [line for line in out0.splitlines() if line.startswith("STOPPED")]
    assert stopped, out0[-3000:]
    message = stopped[0]
    assert "rank 1 (silent" in message and "rank 0 (silent" not in message, message
    assert float(message.split()[2]) < 15, "took too long to notice"
    assert time.monotonic() - start < 90
