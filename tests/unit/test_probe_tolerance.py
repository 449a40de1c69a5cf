"""The probe's tolerance (``megathunder.trainer.probe.ProbeTolerance``): calibrated on the same
weights, following accepted pushes' gaps, but bounded so that it cannot ratchet itself up."""

from __future__ import annotations

from megathunder.trainer.probe import ProbeTolerance


def test_tolerance_follows_accepted_gaps_up_to_margin_times_the_calibrated_floor():
    tol = ProbeTolerance(minimum=1e-3, margin=10.0)
    assert tol.value == 1e-3  # before calibration: the minimum
    tol.calibrate([0.01, 0.02, 0.015])
    assert tol.value == 0.2  # margin x f0
    tol.accept(0.05)  # numerics on new weights (bf16 rounding grows with the logits)
    assert tol.value == 0.5
    for _ in range(10):  # each push accepted just below tau: without the bound tau would grow 10x per push
        tol.accept(0.99 * tol.value)
    assert tol.floor == 10.0 * 0.02 and tol.value == 10.0 * 10.0 * 0.02  # margin^2 x f0 at most
    tol.accept(1e-6)
    assert tol.value == 2.0  # never lowered by a small gap


def test_the_minimum_holds_for_a_tiny_floor():
    tol = ProbeTolerance(minimum=1e-3, margin=10.0)
    tol.calibrate([1e-7])
    tol.accept(5e-7)
    assert tol.value == 1e-3
