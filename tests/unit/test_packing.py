"""``pack_micro_batches``: the grouping of trajectories into packed micro-batches
(``learner.pack_tokens``, ``megathunder.learner.backend.run_schedule``) is what its docstring says."""

from __future__ import annotations

import random

import pytest

from megathunder.config import LearnerConfig
from megathunder.trajectory import pack_micro_batches


def _cost(lengths, group):
    return len(group) * max(lengths[i] for i in group)


@pytest.mark.parametrize("seed", range(20))
def test_groups_keep_order_respect_the_cap_and_are_greedy(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
    cap = rng.choice([0, 1, 16, 50, 120, 10_000])
    groups = pack_micro_batches(lengths, cap)
    assert [i for g in groups for i in g] == list(range(len(lengths)))  # order preserved, nothing lost
    for g in groups:
        assert len(g) == 1 or _cost(lengths, g) <= cap  # rows x longest within the cap, or alone
    for g, nxt in zip(groups, groups[1:]):
        assert _cost(lengths, g + nxt[:1]) > cap  # greedy: the next item did not fit


def test_an_over_long_trajectory_is_alone_and_zero_means_one_per_micro_batch():
    assert pack_micro_batches([3, 3, 3, 10, 2, 2], 9) == [[0, 1, 2], [3], [4, 5]]
    assert pack_micro_batches([2, 100, 2], 10) == [[0], [1], [2]]
    assert pack_micro_batches([5, 5, 5], 0) == [[0], [1], [2]]
    assert pack_micro_batches([4, 4, 8], 16) == [[0, 1], [2]]  # 3 x 8 = 24 > 16: the longest row counts
    assert pack_micro_batches([], 64) == []


def test_pack_tokens_is_validated_at_parse_time():
    with pytest.raises(ValueError, match="pack_tokens"):
        LearnerConfig.model_validate({"pack_tokens": -1})
