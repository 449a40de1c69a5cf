"""The checkpoint writer's results-queue manager (``megathunder.learner.checkpoint_writer``) is
forked from the learner rank, before the learner is built, so it holds none of the learner's
memory; a rank killed outright (``kill_learner``, the OOM killer) runs no exit hook
that would stop it. ``_die_with_parent`` makes the kernel SIGKILL it when the thread that forked it
ends -- else the orphan lives on, holding the launcher's stdout/stderr pipes (the real-run test of
the learner faults hung on exactly that). Checked with a stand-in rank: a process that starts the
manager as ``forked_results_queue`` does, then is SIGKILLed."""

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
from megathunder.learner.checkpoint_writer import _die_with_parent
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


LATE_STATE = """
import sys, torch
from megathunder.learner import checkpoint_writer
if sys.argv[1] == "early":
    checkpoint_writer.start_results_queue()  # what MegatronLearner.build does before the model
state = torch.ones(2**28)  # 1 GiB the learner has written by its first save
checkpoint_writer.forked_results_queue()  # what save_checkpoint does
pid = checkpoint_writer._manager._process.pid
print(int(next(l for l in open(f"/proc/{pid}/status") if l.startswith("VmRSS")).split()[1]) * 1024, flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
@pytest.mark.parametrize("when", ["early", "at_save"])
def test_a_manager_forked_before_the_learner_holds_none_of_its_memory(when):
    """Forked at the first save, the manager's image holds the learner's pages (and each page the
    learner rewrites is then copied: twice its memory); forked first, only the interpreter's own
    (~270 MB of Python, torch and Megatron here)."""
    out = subprocess.run([sys.executable, "-c", LATE_STATE, when], env=ENV, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rss = int(out.stdout.split()[-1])
    if when == "early":
        assert rss < 2**29, rss
    else:  # the failure it guards against, seen
        assert rss > 2**30, rss
