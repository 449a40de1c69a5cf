"""The unbiased pass@k estimator against exhaustive enumeration of k-subsets, exact rationals and
hand-computed values; its standard error across instances."""

from __future__ import annotations

import itertools
import math
import statistics
from fractions import Fraction

import pytest

from megathunder.eval.passk import mean_and_stderr, pass_at_k, pass_at_k_over_instances


def _enumerated(n: int, c: int, k: int) -> Fraction:
    """Share of the k-subsets of n samples (the first c correct) that hold a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(any(i < c for i in s) for s in subsets)
    return Fraction(hits, len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_matches_enumeration_of_every_subset(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(_enumerated(n, c, k)), abs=1e-12), (
                n, c, k,
            )  # fmt: skip


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - 1/6
        (4, 1, 3, 0.75),  # 1 - C(3,3)/C(4,3) = 1 - 1/4
        (10, 3, 1, 0.3),  # pass@1 = c / n
        (5, 0, 5, 0.0),
        (5, 1, 5, 1.0),  # all samples drawn: pass iff any passes
        (3, 2, 2, 1.0),  # n - c < k
    ],
)
def test_known_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize(("n", "c", "k"), [(200, 1, 10), (1000, 3, 100), (500, 250, 50), (64, 5, 32)])
def test_large_n_is_stable(n, c, k):
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


def test_bad_inputs():
    with pytest.raises(ValueError, match="at least 3 samples"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k must be"):
        pass_at_k(4, 1, 0)
    with pytest.raises(TypeError):
        pass_at_k(4.0, 1, 1)
    with pytest.raises(ValueError, match="zero instances"):
        pass_at_k_over_instances([], 1)


def test_mean_and_stderr_across_instances():
    counts = [(4, 0), (4, 1), (4, 2), (4, 4)]
    mean, se = pass_at_k_over_instances(counts, 1)
    values = [0.0, 0.25, 0.5, 1.0]
    assert mean == pytest.approx(0.4375)
    assert se == pytest.approx(statistics.stdev(values) / 2)
    mean2, _ = pass_at_k_over_instances(counts, 2)
    assert mean2 == pytest.approx((0 + 0.5 + 5 / 6 + 1) / 4)
    assert math.isnan(mean_and_stderr([0.3])[1])
    assert mean_and_stderr([0.5, 0.5]) == (0.5, 0.0)
