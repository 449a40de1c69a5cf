"""A rollout server SIGKILLed (chaos ``kill_server``, or the OOM killer) cannot remove its shared
memory; ``ServerProcess.stop`` removes the /dev/shm files its process group held once it was ready."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megathunder.rollout.engines.server import ServerProcess

# A stand-in server: a shared-memory segment (as vLLM's message queues) and a child in its group
# that maps another; prints both names, then waits to be killed.
SCRIPT = """
import subprocess, sys, time
from multiprocessing import shared_memory
own = shared_memory.SharedMemory(create=True, size=4096)
child = subprocess.Popen([sys.executable, "-c", '''
from multiprocessing import shared_memory
import sys, time
m = shared_memory.SharedMemory(create=True, size=4096)
print(m.name, flush=True)
time.sleep(600)
'''], stdout=subprocess.PIPE, text=True)
print(own.name, child.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


def test_a_killed_server_s_shared_memory_is_removed_by_stop(tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    server = ServerProcess("http://127.0.0.1:1", proc, tmp_path / "log")
    try:
        assert proc.stdout is not None
        names = proc.stdout.readline().split()
        assert len(names) == 2, names
        paths = [f"/dev/shm/{name}" for name in names]
        assert all(os.path.exists(p) for p in paths)
        server.record_shm()
        assert set(paths) <= set(server.shm), server.shm
        os.killpg(proc.pid, signal.SIGKILL)  # the fault: nothing of the server can clean up
        proc.wait(timeout=30)
        time.sleep(0.5)
        assert all(os.path.exists(p) for p in paths), "the stand-in must leak as a SIGKILLed vLLM does"
    finally:
        server.stop(timeout_s=5)
    assert not any(os.path.exists(p) for p in paths)


def test_stop_leaves_other_processes_shared_memory_alone(tmp_path: Path):
    from multiprocessing import shared_memory

    mine = shared_memory.SharedMemory(create=True, size=4096)
    try:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        server = ServerProcess("http://127.0.0.1:1", proc, tmp_path / "log")
        server.record_shm()
        assert f"/dev/shm/{mine.name}" not in server.shm
        server.stop(timeout_s=5)
        assert os.path.exists(f"/dev/shm/{mine.name}")
    finally:
        mine.close()
        mine.unlink()


def test_the_pool_removes_start_up_files_no_process_holds(tmp_path: Path):
    """A semaphore a server's start-up helper left for the servers' resource tracker (which a SIGKILL
    takes with it) is removed when the pool stops -- unless some process still maps it."""
    from multiprocessing import shared_memory

    from megathunder.rollout.engines.server import ServerPool

    orphan = shared_memory.SharedMemory(create=True, size=4096)
    orphan.close()  # nobody maps it any more; its name stays, as a dead tracker leaves it
    held = shared_memory.SharedMemory(create=True, size=4096)  # mapped by this live process
    try:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        pool = ServerPool([ServerProcess("http://127.0.0.1:1", proc, tmp_path / "log")])
        pool.startup_shm = {f"/dev/shm/{orphan.name}", f"/dev/shm/{held.name}"}
        pool.stop()
        assert not os.path.exists(f"/dev/shm/{orphan.name}")
        assert os.path.exists(f"/dev/shm/{held.name}")
    finally:
        held.close()
        held.unlink()
        if os.path.exists(f"/dev/shm/{orphan.name}"):
            orphan.unlink()
