"""Blocking verifiers for the subprocess tests. Standard library only: the verifier's module is
imported in every verifier process, so it must be cheap to import."""

from __future__ import annotations

import os
import time


def blocking_reward(x: float) -> float:
    return 2 * x


def blocking_hang(x: float) -> float:
    time.sleep(3600)
    return x


def blocking_crash(x: float) -> float:
    raise ZeroDivisionError("bad grader")


def blocking_abort(x: float) -> float:
    os.abort()
