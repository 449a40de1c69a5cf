"""A server fault for a server the run did not launch (``chaos.faults`` kill_server / hang_server
with ``rollout.engine.server_urls``) goes through the server's authenticated dev endpoint: a worker
signals the API server it descends from and every process under it (``signal_server``). Here the
process tree stands in for a server's: an "API server" (its command line names vLLM's) with an
engine core under it and a worker under that, which takes the call."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megathunder.rollout.engines.worker_extension import API_SERVER

TREE = f"""
import os, subprocess, sys, time
# {API_SERVER}: the API server's command line
core = subprocess.Popen([sys.executable, "-c", '''
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdin.readline(); \
from megathunder.rollout.engines.worker_extension import signal_server; \
print(signal_server(sys.argv[1]), flush=True); time.sleep(60)", sys.argv[1]], stdin=sys.stdin)
print(worker.pid, flush=True)
time.sleep(60)
''', sys.argv[1]], stdin=sys.stdin)
time.sleep(60)
"""


@pytest.mark.parametrize("kind,state", [("kill", None), ("hang", psutil.STATUS_STOPPED)])
def test_a_worker_signals_its_whole_server(kind, state):
    server = subprocess.Popen([sys.executable, "-c", TREE, kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.getcwd()}, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(tree := [server.pid, *(p.pid for p in psutil.Process(server.pid).children(recursive=True))]) < 3:
            assert time.monotonic() < deadline, tree
            time.sleep(0.1)
        assert server.stdin is not None
        server.stdin.write("go\n")  # the worker takes the call
        server.stdin.flush()
        deadline = time.monotonic() + 60
        for pid in tree:
            while True:
                try:
                    status = psutil.Process(pid).status()
                except psutil.NoSuchProcess:
                    status = None
                if status in (state, psutil.STATUS_ZOMBIE) or (state is None and status is None):
                    break
                assert time.monotonic() < deadline, (pid, status)
                time.sleep(0.05)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


def test_a_process_outside_a_server_is_refused():
    from megathunder.rollout.engines.worker_extension import signal_server

    with pytest.raises(RuntimeError, match="no ancestor"):
        signal_server("kill")
    with pytest.raises(ValueError, match="kill or hang"):
        signal_server("explode")
