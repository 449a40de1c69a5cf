"""Batch pieces that need no engine: DP ownership by token count, failed-trajectory group drops."""

from __future__ import annotations

import random

import pytest
import torch

from megathunder.streaming import synthetic as syn

from megathunder.trajectory import batch_plan
from megathunder.config import GRPOObjective, LedgerConfig
from megathunder.streaming.reference import reference_gradient
from megathunder.streaming import GradientLedger, LedgerError, TorchBackend
from megathunder.learner.batches import Ownership
from tests.helpers import make_case, rel_err, small_model


def test_ownership_is_deterministic_balanced_and_agreed_by_every_rank():
    rng = random.Random(0)
    sizes = [rng.randint(1, 50) for _ in range(40)]
    ranks = [Ownership(4, r) for r in range(4)]
    mine = [[o.claim(i, n) for i, n in enumerate(sizes)] for o in ranks]
    assert all(sum(col) == 1 for col in zip(*mine))  # every trajectory has exactly one owner
    load = ranks[0].load
    assert all(o.load == load for o in ranks) and max(load) - min(load) <= max(sizes)
    assert Ownership(3, 0).claim(0, 5)  # ties go to the lowest rank
    later = Ownership(2, 0)
    assert later.claim(7, 10) and later.load == [10, 0]
    assert later.claim(7, 5) and later.load == [15, 0]  # a later turn adds to its owner's load
    assert later.settle(7, 100) and later.load == [15, 0]  # settle: an owner already, nothing added
    assert not later.settle(8, 3) and later.load == [15, 3]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo"])
def test_failed_trajectory_drops_its_group_exactly(seed, advantage):
    """Held groups: the update equals the reference on the groups that had no failure."""
    model = small_model("float64")
    rng, batch, rewards = make_case(500 + seed, torch.float64, "continuous")
    objective = GRPOObjective(advantage=advantage, kl_coef=rng.choice([0.0, 0.05]),
                                dapo_dynamic_sampling=rng.random() < 0.5)
    plan = batch_plan(batch)
    failed_group = rng.choice(plan)[0]
    failed = rng.choice([t.traj_id for t in batch if t.group_id == failed_group])
    backend = TorchBackend(model, objective)
    ledger = GradientLedger(backend, objective, LedgerConfig(max_group_slots=rng.choice([0, 1, None]),
                                                             hold_groups_until_close=True))
    ledger.begin_batch(plan)
    by_id = {t.traj_id: t for t in batch}
    for ev in syn.random_event_order(rng, len(batch)):
        if ev.kind == "finished":
            ledger.on_finished(by_id[ev.traj_id])
        else:
            ledger.on_reward(ev.traj_id, None if ev.traj_id == failed else rewards[ev.traj_id])
    result = ledger.close_batch()
    kept = [(t, r) for t, r in zip(batch, rewards) if t.group_id != failed_group]
    assert result.num_dropped_groups >= 1
    if not kept:
        return
    reference = reference_gradient(model, [t for t, _ in kept], [r for _, r in kept], objective)
    assert rel_err(backend.live.flat(), reference) <= 1e-10


def test_failure_without_hold_is_refused_once_the_group_may_be_in_the_update():
    model = small_model("float64")
    _, batch, rewards = make_case(7, torch.float64, "continuous")
    objective = GRPOObjective(advantage="dr_grpo")  # std-free: rewards go to P at once
    ledger = GradientLedger(TorchBackend(model, objective), objective, LedgerConfig())
    ledger.begin_batch(batch_plan(batch))
    group = max(([t for t in batch if t.group_id == g] for g in {t.group_id for t in batch}), key=len)
    assert len(group) >= 2, "case 7 must hold a group of two or more"
    for t in group:
        ledger.on_finished(t)
    ledger.on_reward(group[0].traj_id, rewards[group[0].traj_id])
    with pytest.raises(LedgerError, match="hold_groups_until_close"):
        ledger.on_reward(group[1].traj_id, None)
