"""Bad events are errors that leave the ledger's state untouched, never silent corruption."""

from __future__ import annotations

import math

import pytest
import torch

from megathunder.streaming import synthetic as syn

from megathunder.trajectory import batch_plan
from megathunder.config import GRPOObjective, LedgerConfig
from megathunder.streaming.reference import reference_gradient
from megathunder.streaming import GradientLedger, LedgerError, TorchBackend
from tests.helpers import make_case, rel_err, small_model


@pytest.fixture
def setup():
    model = small_model("float64")
    objective = GRPOObjective(kl_coef=0.05)
    rng, batch, rewards = make_case(31, torch.float64, "continuous")
    backend = TorchBackend(model, objective)
    ledger = GradientLedger(backend, objective, LedgerConfig(max_group_slots=1))
    ledger.begin_batch(batch_plan(batch))
    return model, objective, batch, rewards, backend, ledger


def _finish_rest(ledger, batch, rewards, finished=(), rewarded=()):
    for t in batch:
        if t.traj_id not in finished:
            ledger.on_finished(t)
    for t in batch:
        if t.traj_id not in rewarded:
            ledger.on_reward(t.traj_id, rewards[t.traj_id])
    ledger.close_batch()


def _assert_still_exact(model, objective, batch, rewards, backend):
    ref = reference_gradient(model, batch, rewards, objective)
    assert rel_err(backend.live.flat(), ref) <= 1e-10


def test_reward_for_unknown_trajectory(setup):
    model, objective, batch, rewards, backend, ledger = setup
    with pytest.raises(LedgerError, match="unknown trajectory 12345"):
        ledger.on_reward(12345, 1.0)
    _finish_rest(ledger, batch, rewards)
    _assert_still_exact(model, objective, batch, rewards, backend)


def test_duplicate_reward(setup):
    model, objective, batch, rewards, backend, ledger = setup
    first = batch[0]
    ledger.on_finished(first)
    ledger.on_reward(first.traj_id, rewards[0])
    with pytest.raises(LedgerError, match="duplicate reward"):
        ledger.on_reward(first.traj_id, rewards[0] + 1.0)
    _finish_rest(ledger, batch, rewards, finished={first.traj_id}, rewarded={first.traj_id})
    _assert_still_exact(model, objective, batch, rewards, backend)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward(setup, bad):
    model, objective, batch, rewards, backend, ledger = setup
    ledger.on_finished(batch[0])
    with pytest.raises(LedgerError, match="non-finite reward"):
        ledger.on_reward(batch[0].traj_id, bad)
    _finish_rest(ledger, batch, rewards, finished={batch[0].traj_id})
    _assert_still_exact(model, objective, batch, rewards, backend)


def test_batch_closed_while_a_group_is_open(setup):
    model, objective, batch, rewards, backend, ledger = setup
    for t in batch:
        ledger.on_finished(t)
    for t in batch[:-1]:
        ledger.on_reward(t.traj_id, rewards[t.traj_id])
    with pytest.raises(LedgerError, match=f"group {batch[-1].group_id} is still open"):
        ledger.close_batch()
    ledger.on_reward(batch[-1].traj_id, rewards[-1])
    ledger.close_batch()
    _assert_still_exact(model, objective, batch, rewards, backend)


def test_reward_before_finish_and_double_finish(setup):
    _, _, batch, _, _, ledger = setup
    with pytest.raises(LedgerError, match="before the trajectory finished"):
        ledger.on_reward(batch[0].traj_id, 1.0)
    ledger.on_finished(batch[0])
    with pytest.raises(LedgerError, match="finished twice"):
        ledger.on_finished(batch[0])


def test_events_outside_a_batch_and_bad_plans():
    model = small_model("float64")
    ledger = GradientLedger(TorchBackend(model, GRPOObjective()), GRPOObjective())
    with pytest.raises(LedgerError, match="no batch is open"):
        ledger.on_reward(0, 1.0)
    with pytest.raises(LedgerError, match="no batch is open"):
        ledger.close_batch()
    with pytest.raises(LedgerError, match="listed twice"):
        ledger.begin_batch([(0, [0, 1]), (1, [1])])
    with pytest.raises(LedgerError, match="is empty"):
        ledger.begin_batch([(0, [])])
    with pytest.raises(LedgerError, match="add_group 1: no batch is open"):
        ledger.add_group(1, [1])
    ledger.begin_batch([(0, [0])])
    with pytest.raises(LedgerError, match="still open"):
        ledger.begin_batch([(0, [0])])


def test_a_group_added_twice_or_overlapping_is_refused_and_changes_nothing(setup):
    model, objective, batch, rewards, backend, ledger = setup
    last = batch[-1]
    with pytest.raises(LedgerError, match=f"add_group: group {last.group_id} listed twice"):
        ledger.add_group(last.group_id, [10_000])
    with pytest.raises(LedgerError, match=f"add_group: trajectory {last.traj_id} listed twice"):
        ledger.add_group(10_000, [10_001, last.traj_id])
    with pytest.raises(LedgerError, match="add_group: group 10000 is empty"):
        ledger.add_group(10_000, [])
    _finish_rest(ledger, batch, rewards)  # the batch is the one declared: the refused calls left no trace
    _assert_still_exact(model, objective, batch, rewards, backend)


def test_finish_in_the_wrong_group(setup):
    _, _, batch, _, _, ledger = setup
    t = batch[0]
    t.group_id += 1000
    try:
        with pytest.raises(LedgerError, match="the batch places it in group"):
            ledger.on_finished(t)
    finally:
        t.group_id -= 1000


@pytest.mark.parametrize("bad", ["1", True, torch.tensor(1.0), torch.tensor([1.0]), [1.0]])
def test_a_reward_that_is_not_a_real_number_is_refused_by_name(setup, bad):
    """``float("1")``, ``float(True)`` and ``float(torch.tensor(1.0))`` are all 1.0: taken as given
    they would train; refused, the batch goes on and stays exact."""
    model, objective, batch, rewards, backend, ledger = setup
    ledger.on_finished(batch[0])
    with pytest.raises(LedgerError, match=f"trajectory {batch[0].traj_id}: reward .* is not a real number"):
        ledger.on_reward(batch[0].traj_id, bad)
    _finish_rest(ledger, batch, rewards, finished={batch[0].traj_id})
    _assert_still_exact(model, objective, batch, rewards, backend)


def test_integer_and_numpy_rewards_are_real_numbers(setup):
    import numpy as np

    model, objective, batch, rewards, backend, ledger = setup
    ledger.on_finished(batch[0])
    ledger.on_reward(batch[0].traj_id, np.float64(rewards[0]))  # a numpy float is a real number
    _finish_rest(ledger, batch, rewards, finished={batch[0].traj_id}, rewarded={batch[0].traj_id})
    _assert_still_exact(model, objective, batch, rewards, backend)


def test_a_backend_built_with_another_objective_is_refused():
    """A ``TorchBackend`` computing token-mean losses under a ledger whose coefficients assume
    seq-mean-token-mean gave a gradient 4x off, silently."""
    model = small_model("float64")
    backend = TorchBackend(model, GRPOObjective(loss_agg="token_mean"))
    with pytest.raises(LedgerError, match="another objective than the ledger's .*loss_agg"):
        GradientLedger(backend, GRPOObjective(loss_agg="seq_mean_token_mean"))
    GradientLedger(backend, GRPOObjective(loss_agg="token_mean"))  # an equal objective is the same one


def test_an_objective_without_a_reward_part_is_refused_at_construction():
    from megathunder.config import OPDObjective

    model = small_model("float64")
    with pytest.raises(LedgerError, match="objective.kind=opd has no reward part"):
        GradientLedger(TorchBackend(model, GRPOObjective()), OPDObjective())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="objective.kind=opd has no reward part"):
        TorchBackend(model, OPDObjective())  # type: ignore[arg-type]
