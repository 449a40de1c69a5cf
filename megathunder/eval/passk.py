"""The unbiased pass@k estimator (Chen et al., 2021, "Evaluating Large Language Models Trained on
Code") and its standard error across instances.

With ``n`` samples of an instance of which ``c`` pass, the probability that a uniformly drawn
subset of ``k`` of them holds at least one pass is

    pass@k = 1 - C(n - c, k) / C(n, k).

The ratio of binomials overflows floats long before it is small, so it is computed as a product
of ``c`` factors: C(n-c, k) / C(n, k) = prod_{i = n-c+1}^{n} (1 - k / i) (write both binomials as
factorials; the (n-k)! / (n-k-c)! over n! / (n-c)! telescopes). Each factor lies in [0, 1), so
the product never overflows and loses no more than c roundings. When n - c < k every subset holds
a pass and the estimate is exactly 1.

Across instances, the score is the mean of the per-instance estimates and its standard error the
sample standard deviation of those estimates over sqrt(num_instances) (the instances are the
independent draws; the k-of-n resampling within an instance is already averaged out exactly).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one instance with ``num_correct`` passes among ``num_samples``."""
    n, c = num_samples, num_correct
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError(f"pass_at_k takes integers, got n={n!r}, c={c!r}, k={k!r}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not 0 <= c <= n:
        raise ValueError(f"num_correct must be in [0, num_samples={n}], got {c}")
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} samples per instance, got {n}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample std, ddof 1); the error is NaN for one value."""
    num = len(values)
    if num == 0:
        raise ValueError("no values: a score over zero instances is undefined")
    mean = math.fsum(values) / num
    if num == 1:
        return mean, math.nan
    var = math.fsum((v - mean) ** 2 for v in values) / (num - 1)
    return mean, math.sqrt(var / num)


def pass_at_k_over_instances(
    counts: Sequence[tuple[int, int]], k: int
) -> tuple[float, float]:
    """(pass@k, standard error) over instances given as ``(num_samples, num_correct)`` pairs."""
    return mean_and_stderr([pass_at_k(n, c, k) for n, c in counts])
