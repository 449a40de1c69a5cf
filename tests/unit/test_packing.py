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
def test_groups_take_the_longest_first_respect_the_cap_and_are_greedy(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
    cap = rng.choice([1, 16, 50, 120, 10_000])
    groups = pack_micro_batches(lengths, cap)
    order = [i for g in groups for i in g]
    assert sorted(order) == list(range(len(lengths)))  # nothing lost, nothing twice
    assert order == sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))  # longest first, ties by index
    for g in groups:
        assert len(g) == 1 or _cost(lengths, g) <= cap  # rows x longest within the cap, or alone
    for g, nxt in zip(groups, groups[1:]):
        assert _cost(lengths, g + nxt[:1]) > cap  # greedy: the next item did not fit


def test_rows_of_like_length_share_a_micro_batch():
    """One long trajectory among short ones no longer pads them all: packed in arrival order,
    [800, 200, 800, 200] at a cap of 1600 was two [2, 800] micro-batches, 1600 tokens of padding."""
    assert pack_micro_batches([800, 200, 800, 200], 1600) == [[0, 2], [1, 3]]
    assert pack_micro_batches([3, 3, 3, 10, 2, 2], 9) == [[3], [0, 1, 2], [4, 5]]


def test_an_over_long_trajectory_is_alone_and_zero_means_one_per_micro_batch_in_order():
    assert pack_micro_batches([2, 100, 2], 10) == [[1], [0, 2]]
    assert pack_micro_batches([5, 7, 5], 0) == [[0], [1], [2]]
    assert pack_micro_batches([4, 4, 8], 16) == [[2, 0], [1]]  # 3 x 8 = 24 > 16: the longest row counts
    assert pack_micro_batches([], 64) == []


def test_pack_tokens_is_validated_at_parse_time():
    with pytest.raises(ValueError, match="pack_tokens"):
        LearnerConfig.model_validate({"pack_tokens": -1})
