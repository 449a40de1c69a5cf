"""``pack_micro_batches``: the grouping of trajectories into packed micro-batches
(``learner.pack_tokens``, ``megathunder.learner.micro_batches.PackedRows``) is what its docstring says."""

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


@pytest.mark.parametrize("seed", range(10))
def test_a_micro_batchs_inputs_labels_and_loss_targets_are_each_rows_own(seed):
    """The packed micro-batch's tensors, built for all rows at once (``loss_targets``,
    ``micro_batches._inputs_and_labels`` / ``to_rows``), equal the per-row definitions exactly: row r
    holds its tokens but the last as inputs and but the first as labels, zeros after; its loss
    targets are ``loss_mask.nonzero()``; values at the targets land at those positions, zeros elsewhere."""
    import torch

    from megathunder.learner.micro_batches import _inputs_and_labels, to_rows
    from megathunder.trajectory import Trajectory, loss_targets

    rng = random.Random(seed)
    trajs = []
    for i in range(rng.randint(1, 12)):
        n = rng.randint(1, 30)  # targets
        mask = torch.tensor([rng.random() < 0.4 for _ in range(n)])
        trajs.append(Trajectory(traj_id=i, group_id=0, tokens=torch.randint(0, 500, (n + 1,)), loss_mask=mask))
    counts, at = loss_targets(trajs)
    assert counts == [int(t.loss_mask.sum()) for t in trajs]
    assert all(torch.equal(a, t.loss_mask.nonzero().squeeze(-1)) for a, t in zip(at, trajs))
    width = max(t.tokens.numel() - 1 for t in trajs) + rng.randint(0, 3)
    inputs, labels = _inputs_and_labels([t.tokens for t in trajs], width, torch.device("cpu"))
    for row, t in enumerate(trajs):
        n = t.tokens.numel() - 1
        assert torch.equal(inputs[row, :n], t.tokens[:-1]) and torch.equal(labels[row, :n], t.tokens[1:])
        assert not inputs[row, n:].any() and not labels[row, n:].any()
    rows = torch.repeat_interleave(torch.arange(len(trajs)), torch.tensor(counts))
    values = torch.randn(sum(counts), dtype=torch.float64)
    parts = values.split(counts)
    for row, (t, got) in enumerate(zip(trajs, to_rows(values, rows, torch.cat(at), [t.tokens.numel() - 1 for t in trajs]))):
        want = torch.zeros(t.tokens.numel() - 1, dtype=torch.float64).index_put((at[row],), parts[row])
        assert torch.equal(got, want)
