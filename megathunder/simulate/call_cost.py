"""A learner call's fixed cost F, fitted from calls of different sizes (``learner.call_overhead_s``).

Run the same batch through the learner as different numbers of schedule calls (one packed call, one
per group, one per trajectory: ``megathunder bench learner``'s sync, thunder K = 0, thunder K = inf),
so the trajectories' work is the same in each and only the number of calls c differs. Then

    seconds(c) = a + F c

with a the work, the optimizer step and everything else common to the modes, and F what each call
costs beyond its trajectories' work (schedule set-up, Python, kernel launches, the pipeline's first
and last transfers). F is the least-squares slope over the modes. Each mode must run on the same
batch and layout; more than two modes test the line (the residual is returned with it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BENCH_MODES = ("sync", "thunder_K0", "thunder_Kinf", "thunder_held")  # ``megathunder bench learner``'s


def fit_call_cost(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """(F, a, largest residual in seconds) of ``seconds = a + F calls`` over (calls, seconds)."""
    if len({c for c, _ in points}) < 2:
        raise ValueError("fit_call_cost: needs calls of at least two different counts")
    c = np.array([p[0] for p in points], dtype=float)
    s = np.array([p[1] for p in points], dtype=float)
    F, a = np.polyfit(c, s, 1)
    return float(F), float(a), float(np.abs(s - (a + F * c)).max())


def bench_points(result: dict) -> list[tuple[float, float]]:
    """(calls per rank, seconds) of each mode of one ``megathunder bench learner`` JSON result."""
    return [(float(result["calls"][m]), float(result["step_s"][m])) for m in BENCH_MODES if m in result["calls"]]
