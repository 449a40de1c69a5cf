"""The checkpoint writer's results-queue manager (``megathunder.learner.checkpoint``) is forked
from the learner rank; a rank killed outright (``kill_learner``, the OOM killer) runs no exit hook
that would stop it. ``_die_with_parent`` makes the kernel SIGKILL it when the thread that forked it
ends -- else the orphan lives on, holding the launcher's stdout/stderr pipes (the real-run test of
the learner faults hung on exactly that). Checked with a stand-in rank: a process that starts the
manager as ``_forked_results_queue`` does, then is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.test_trainer import ENV, ROOT

RANK = """
import multiprocessing, sys, threading, time
from multiprocessing.managers import SyncManager
from megathunder.learner.checkpoint import _die_with_parent
manager = SyncManager(ctx=multiprocessing.get_context("fork"))
manager.start(_die_with_parent, (threading.get_native_id(),))
print(manager._process.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
def test_the_forked_manager_dies_with_a_rank_killed_outright():
    rank = subprocess.Popen([sys.executable, "-c", RANK], env=ENV, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None
        manager = int(rank.stdout.readline())
        assert _alive(manager)
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait(timeout=60)
        deadline = time.monotonic() + 60  # the kernel signals it at once; the bound only ends a failing test
        while _alive(manager):
            assert time.monotonic() < deadline, "the manager outlived the rank that forked it"
            time.sleep(0.01)
        assert rank.stdout.read() == ""  # EOF: no process holds the rank's stdout any more
    finally:
        rank.kill()
        rank.wait(timeout=60)
