"""The checkpoint writer's results queue, served by a manager process forked while this process
is small.

Megatron's checkpoint writer (``FileSystemWriterAsync``) forks its writer processes and collects
their results through a queue served by a ``multiprocessing`` Manager, which it starts with
``spawn`` at the first save: a fresh interpreter that imports this program's modules (~3 s of
CPU) and is joined at exit (~3 s). A manager forked from this process serves the same queue
without either cost (forking is what the writers already do); Megatron uses the queue it finds.

When it is forked matters: forked at the first save, the manager would hold a copy-on-write image
of the whole learner for the rest of the run, and every page the learner rewrote after it
(weights, Adam moments, ledger buffers) would be copied -- twice the learner's memory within
minutes (SmolLM2 with its ledger buffers: 12 GB more, killed by the OOM killer two minutes after
its first checkpoint). So ``MegatronLearner.build`` forks it first (``start_results_queue``).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing.managers import SyncManager

_manager: SyncManager | None = None
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def start_results_queue() -> None:
    """Fork the manager now, while this process is small (module docstring): from the main thread
    only, which lives as long as the process; elsewhere the first save forks it."""
    if threading.current_thread() is threading.main_thread():
        forked_results_queue()


def forked_results_queue() -> None:
    """The queue for the next save: the manager forked earlier, or one forked now. It dies with the
    thread that forked it (``_die_with_parent``); one found dead is replaced."""
    global _manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _manager is not None and filesystem_async._results_queue is not None and not _manager_alive():
        filesystem_async._results_queue = None  # its thread ended: serve the queue from a new one
    if filesystem_async._results_queue is None:
        _manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        _manager.start(_die_with_parent, (threading.get_native_id(),))
        filesystem_async._results_queue = _manager.Queue()


def _manager_alive() -> bool:
    process = getattr(_manager, "_process", None)
    return process is not None and process.is_alive()


def _die_with_parent(parent_thread: int) -> None:
    """In the forked manager, first: it is SIGKILLed when the thread that forked it ends (Linux's
    parent-death signal; the thread that saves checkpoints lives as long as the learner). A rank
    killed outright (``kill_learner``, the OOM killer) runs no exit hook that would stop it, and
    the orphan would live on holding the launcher's stdout/stderr pipes (found by the real-run
    test of the learner faults: the launcher never saw the job end)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if not os.path.exists(f"/proc/{os.getppid()}/task/{parent_thread}"):  # it ended before prctl
        os._exit(0)
