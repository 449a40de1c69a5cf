"""Stopping a run: Ctrl-C, Slurm's time-limit signal, and ``kill``.

A run stops in one of two ways, whatever asks for it:

    stop after the step   SIGUSR1 (Slurm ``--signal=B:USR1@T``), or the first Ctrl-C: the current
                          step finishes, a checkpoint is saved, the command exits 75 and the same
                          command resumes from the checkpoint
    stop now              SIGTERM, or a second Ctrl-C: the step in progress is abandoned (the last
                          checkpoint and the crash-consistent journal stay), the engine is closed,
                          the command exits 130. Once the run is closing (after its last step, or
                          the checkpoint of a stop after the step) stop requests change nothing: the
                          close (seconds) finishes and the status is the run's own (0 or 75)

The terminal sends Ctrl-C's SIGINT to every process of its foreground group, vLLM's engine core
included, which would die mid-step. So an interactive single-process ``megathunder train`` runs
supervised: the ``megathunder`` process starts the run as a child in a session of its own (no
terminal signal reaches it or its engine) and turns each SIGINT into the run's own requests above;
SIGTERM, SIGHUP and SIGUSR1 sent to it are passed on. The child dies with it (``PR_SET_PDEATHSIG``).
Runs started by a launcher (torchrun, srun), or with ``MEGATHUNDER_SUPERVISE=0``, get signals from
the launcher and are not supervised.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

STOPPED_EARLY = 75  # exit status: stopped after a step with a checkpoint saved; run again to resume
STOPPED_NOW = 130  # exit status: stopped at once (second Ctrl-C, SIGTERM)
SUPERVISOR_ENV = "MEGATHUNDER_SUPERVISOR_PID"  # set in a supervised run: its supervisor's pid
SUPERVISE_ENV = "MEGATHUNDER_SUPERVISE"
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
KILL_AFTER_S = 60.0  # a run told to stop now that is still alive after this is killed


def should_supervise() -> bool:
    return (os.name == "posix" and SUPERVISOR_ENV not in os.environ
            and os.environ.get(SUPERVISE_ENV, "1") != "0" and not any(k in os.environ for k in LAUNCHER_ENV))


def supervise(argv: Sequence[str], module: str = "megathunder.cli") -> int:
    """Run ``python -m MODULE ARGV`` (``megathunder ARGV``) as a child in its own session; SIGINT
    becomes its stop requests."""
    env = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
    child = subprocess.Popen([sys.executable, "-m", module, *argv], env=env, start_new_session=True)
    interrupts = 0

    def kill_later() -> None:
        timer = threading.Timer(KILL_AFTER_S, lambda: _kill_session(child))
        timer.daemon = True
        timer.start()

    def on_interrupt(signum: int, frame: object) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:
            print("\nmegathunder: Ctrl-C: finishing the current step, then a checkpoint (Ctrl-C again: stop now)",
                  file=sys.stderr, flush=True)
            child.send_signal(signal.SIGUSR1)
        elif interrupts == 2:
            print("\nmegathunder: Ctrl-C: stopping now (Ctrl-C again: kill)", file=sys.stderr, flush=True)
            child.send_signal(signal.SIGTERM)
            kill_later()
        else:
            _kill_session(child)

    def forward(signum: int, frame: object) -> None:
        child.send_signal(signum)
        if signum == signal.SIGTERM:
            kill_later()

    signal.signal(signal.SIGINT, on_interrupt)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, forward)
    return child.wait()


def as_supervised_child() -> None:
    """In a supervised run: die with the supervisor, even if it is killed outright."""
    parent = os.environ.get(SUPERVISOR_ENV)
    if parent is None:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the supervisor's own handlers still forward
        pass
    if os.getppid() != int(parent):  # it died before the line above
        sys.exit(STOPPED_NOW)


def _kill_session(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class StopSignals:
    """The run's side: SIGUSR1 (and SIGINT when unsupervised: first) asks to stop after the step;
    SIGTERM (SIGINT: second) asks to stop now, through ``on_stop_now``. Installed on every rank."""

    def __init__(self) -> None:
        self.after_step = threading.Event()
        self.now = threading.Event()
        self.on_stop_now: list = []  # callables run (in the main thread) when stop-now is asked
        self._closing = False
        signal.signal(signal.SIGUSR1, self._stop_after_step)
        signal.signal(signal.SIGTERM, self._stop_now)
        signal.signal(signal.SIGINT, self._interrupt)

    def _stop_after_step(self, signum: int, frame: object) -> None:
        self.after_step.set()

    def _interrupt(self, signum: int, frame: object) -> None:
        if self.after_step.is_set():
            self._stop_now(signum, frame)
        else:
            print("\nmegathunder: Ctrl-C: finishing the current step, then a checkpoint (Ctrl-C again: stop now)",
                  file=sys.stderr, flush=True)
            self.after_step.set()

    def closing(self) -> None:
        """The run is closing its engine and learner (bounded: vLLM's shutdown waits at most ~5 s
        for its engine core). Stop requests from here on change nothing: closing is what stop-now
        would do; an exception raised into vLLM's shutdown would leave its engine core running and
        the interpreter waiting for it at exit; and once the interpreter finalizes, Python puts
        SIGTERM's and SIGUSR1's default actions back, which would kill the process mid-exit. So those
        two are ignored (an ignored signal stays ignored through finalization), and a Ctrl-C of an
        unsupervised run is only marked."""
        self._closing = True
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)

    def _stop_now(self, signum: int, frame: object) -> None:
        self.after_step.set()
        self.now.set()
        if self._closing:
            return
        if not self.on_stop_now:
            raise StopNow
        for callback in self.on_stop_now:
            callback()


class StopNow(BaseException):
    """Raised where a stop-now request lands outside the step loop (set-up, SFT warm start)."""
