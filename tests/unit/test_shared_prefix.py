"""``megathunder.learner.shared_prefix``: a group's trajectories in one row, their common prefix
once. The layout is checked against each trajectory's own definitions: at the columns that hold its
inputs it finds its own tokens at its own positions, each of those columns sees exactly its own
earlier columns, the head reads its loss targets with their labels, and nothing is lost or doubled."""

from __future__ import annotations

import random

import pytest
import torch

from megathunder.config import LearnerConfig
from megathunder.learner.shared_prefix import micro_batch, shared_rows
from megathunder.trajectory import Trajectory, loss_targets


def _group_batch(rng: random.Random) -> list[Trajectory]:
    """Groups of samples of one prompt each (some completions sharing their first tokens too, some
    groups of one), interleaved in arrival order, with random loss masks."""
    batch: list[Trajectory] = []
    for gid in range(rng.randint(1, 5)):
        prompt = torch.randint(0, 50, (rng.randint(1, 12),))
        opening = torch.randint(0, 50, (rng.randint(0, 3),))  # a shared start of the completions
        for _ in range(rng.choice([1, rng.randint(2, 6)])):
            tail = torch.randint(0, 50, (rng.randint(0, 9),))
            tokens = torch.cat([prompt, opening, tail])
            if tokens.numel() < 2:
                tokens = torch.cat([tokens, torch.tensor([7, 8])])
            mask = torch.rand(tokens.numel() - 1, generator=torch.Generator().manual_seed(rng.getrandbits(31))) < 0.6
            batch.append(Trajectory(traj_id=len(batch), group_id=gid, tokens=tokens, loss_mask=mask))
    rng.shuffle(batch)
    return batch


@pytest.mark.parametrize("seed", range(30))
def test_each_trajectory_finds_its_own_tokens_positions_and_context_in_a_shared_row(seed):
    rng = random.Random(seed)
    items = _group_batch(rng)
    cap = rng.choice([8, 20, 64, 4096])
    rows = shared_rows(items, cap)
    members = [k for row in rows for k in row.members]
    assert sorted(members) == list(range(len(items)))  # every trajectory in exactly one row
    for row in rows:
        assert len({items[k].group_id for k in row.members}) == 1  # a row is one group's
        n = [items[k].tokens.numel() - 1 for k in row.members]
        assert row.width == row.prefix + sum(x - row.prefix for x in n)
        assert len(row.members) == 1 or row.width <= cap
        assert all(torch.equal(items[k].tokens[: row.prefix], items[row.members[0]].tokens[: row.prefix])
                   for k in row.members)  # the prefix is common ...
        group = [k for k in range(len(items)) if items[k].group_id == items[row.members[0]].group_id]
        if len(group) > 1 and row.prefix < min(items[k].tokens.numel() - 1 for k in group):  # ... the group's
            assert len({int(items[k].tokens[row.prefix]) for k in group}) > 1  # longest such

    counts, at = loss_targets(items)
    width = max(row.width for row in rows) + rng.randint(0, 3)  # padded
    mb = micro_batch(items, rows, width, counts, at, torch.device("cpu"))
    assert mb.ks == members
    visible = ~mb.mask[:, 0]  # [b, query, key]
    seen: set[tuple[int, int]] = set()
    row_of = {k: r for r, row in enumerate(rows) for k in row.members}
    for j, k in enumerate(mb.ks):
        traj, r, p = items[k], row_of[k], rows[row_of[k]].prefix
        n = traj.tokens.numel() - 1
        start = p + sum(items[m].tokens.numel() - 1 - p for m in rows[r].members[: rows[r].members.index(k)])
        cols = torch.cat([torch.arange(p), torch.arange(start, start + n - p)])  # its inputs' columns
        assert torch.equal(mb.inputs[r, cols], traj.tokens[:-1])  # its own tokens ...
        assert torch.equal(mb.positions[r, cols], torch.arange(n))  # ... at its own positions
        for t in range(n):  # each column sees exactly the columns of its own positions <= t
            assert set(visible[r, cols[t]].nonzero().squeeze(-1).tolist()) == set(cols[: t + 1].tolist())
        seen.update((r, int(c)) for c in cols[p:])
        # the head: its loss targets in order, at their columns, with their labels
        sel = mb.rows == j
        assert torch.equal(mb.cols[sel], at[k])
        assert torch.equal(mb.head_rows[sel], torch.full_like(at[k], r))
        assert torch.equal(mb.head_cols[sel], cols[at[k]])
        assert torch.equal(mb.labels[sel], traj.tokens[1:][at[k]])
    assert torch.equal(mb.rows, torch.repeat_interleave(torch.arange(len(mb.ks)), torch.tensor([counts[k] for k in mb.ks])))
    for r, row in enumerate(rows):  # the rest of a row is padding, seen by pads only, seeing pads only
        pads = [c for c in range(row.prefix, width) if (r, c) not in seen]
        real = [c for c in range(width) if c not in pads]
        assert len(pads) == width - row.width
        for c in pads:
            assert visible[r, c].any() and not visible[r, c, real].any() and not visible[r, real, c].any()


def test_share_prefixes_set_where_it_cannot_apply_is_refused_at_parse_time():
    for bad in ({"precision": {"core_attention": "megatron"}}, {"loss_logits_only": False}, {"pack_tokens": 0}):
        with pytest.raises(ValueError, match="share_prefixes"):
            LearnerConfig.model_validate({"share_prefixes": True, **bad})
        LearnerConfig.model_validate(bad)  # the default steps aside


def _model(core: torch.nn.Module, num_moe_experts: int | None = None) -> torch.nn.Module:
    from types import SimpleNamespace

    model = torch.nn.Module()
    model.config = SimpleNamespace(num_moe_experts=num_moe_experts, apply_rope_fusion=False)
    model.position_embedding_type = "rope"
    model.layer = torch.nn.Module()
    model.layer.core_attention = core
    return model


def test_share_prefixes_on_a_model_that_cannot_take_shared_rows_is_off_with_one_line(caplog):
    """``learner.share_prefixes`` (on by default) cannot apply on the Transformer Engine spec (its
    core attention does not read a row's mask) nor to a MoE model: it is off there -- said once,
    with why, instead of silently."""
    import logging

    from megathunder.learner.sdpa_attention import SDPAttention
    from megathunder.learner.shared_prefix import resolve

    ours = SDPAttention.__new__(SDPAttention)
    torch.nn.Module.__init__(ours)
    with caplog.at_level(logging.WARNING, logger="megathunder.learner.shared_prefix"):
        assert resolve(True, _model(ours)) and not caplog.records
        assert not resolve(True, _model(torch.nn.Module()))  # TE's DotProductAttention, say
        assert not resolve(True, _model(ours, num_moe_experts=8))
        assert not resolve(False, _model(ours)) and not resolve(True, _model(torch.nn.Module()), report=False)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all(m.startswith("learner.share_prefixes: off for this model") for m in said), said
    assert "core attention" in said[0] and "MoE" in said[1]
