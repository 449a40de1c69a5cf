"""Zero advantages cost nothing: ``objective.skip_zero_advantage`` runs no pass for a trajectory
whose advantage is 0 with no reward-free term due, and ``ledger.defer_uniform_groups`` keeps a
group's trajectories out of slots until two of its rewards differ, so a group whose rewards are
all equal (every sample of a hard task failed) runs nothing at all.

Both leave the update the batch-synchronous one: fp64 within 1e-10 under random event orders for
every advantage, aggregation, K and pending limit; skipping alone is bitwise (a skipped term adds
an exact 0). And both can be seen to work: the passes they save are counted.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from megathunder.config import GRPOObjective, LedgerConfig
from megathunder.streaming import synthetic as syn
from megathunder.trajectory import batch_plan
from tests.helpers import rel_err, small_model
from tests.unit.test_pending_gradients import gapped_event_order, kept_reference, pending_limit, run_case
from tests.unit.test_streaming_exact import ADVANTAGES, AGGREGATIONS, SLOTS, random_objective

GRID = list(itertools.product(ADVANTAGES, AGGREGATIONS, SLOTS, ["off", "capped"], [False, True]))  # 256 cases


def task_rewards(rng: random.Random, batch) -> list[float]:
    """Binary rewards drawn per group from a solve rate of 0, 0.2, 0.5 or 1: most groups of hard
    or easy tasks come out uniform, as on SWE-style tasks."""
    rate = {gid: rng.choice([0.0, 0.0, 0.2, 0.5, 1.0]) for gid, _ in batch_plan(batch)}
    return [float(rng.random() < rate[t.group_id]) for t in batch]


def make(seed: int):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 6) for _ in range(rng.randint(3, 5))]
    batch = syn.random_batch(rng, sizes, 32, 12, torch.float64)
    return rng, batch, task_rewards(rng, batch)


def uniform_members(batch, rewards) -> set[int]:
    return {i for gid, members in batch_plan(batch) if len({rewards[i] for i in members}) == 1 for i in members}


@pytest.fixture(scope="module")
def model64():
    return small_model("float64")


@pytest.mark.parametrize("case", range(len(GRID)))
def test_skipping_and_deferring_give_the_batch_update_fp64(model64, case):
    advantage, loss_agg, slots, pending, defer = GRID[case]
    rng, batch, rewards = make(31000 + case)
    objective = random_objective(rng, advantage, loss_agg)
    hold = rng.random() < 0.3
    cfg = LedgerConfig(max_group_slots=slots, max_pending=pending_limit(rng, pending), defer_uniform_groups=defer,
                       hold_groups_until_close=hold, reward_free_terms=rng.choice(["with_score", "at_finish"]))
    packed = rng.random() < 0.5
    events = gapped_event_order(rng, len(batch))
    queued = [rng.random() < 0.6 for _ in events] if packed else None
    streamed, result, _ = run_case(model64, batch, rewards, objective, cfg, events, packed=packed, queued=queued)
    reference = kept_reference(model64, batch, rewards, objective, None)
    if reference is None:
        assert result.num_kept_groups == 0 and streamed.abs().max() == 0
        return
    assert rel_err(streamed, reference) <= 1e-10, (objective, cfg, packed)


@pytest.mark.parametrize("case", range(24))
def test_a_closed_group_s_zero_advantages_run_no_pass_and_change_no_bit(model64, case):
    """K = 0 (every group direct at its close), no reward-free term: the trajectories of uniform
    groups run no pass with skipping on, and the gradient is bitwise the one with it off."""
    advantage = ADVANTAGES[case % 4]
    rng, batch, rewards = make(32000 + case)
    objective = GRPOObjective(advantage=advantage, loss_agg=rng.choice(AGGREGATIONS), loss_agg_norm_tokens=32)
    events = gapped_event_order(rng, len(batch))
    packed = case % 2 == 1
    on, result, counted = run_case(model64, batch, rewards, objective, LedgerConfig(max_group_slots=0), events,
                                   packed=packed)
    off, _, counted_off = run_case(model64, batch, rewards, objective.model_copy(update={"skip_zero_advantage": False}),
                                   LedgerConfig(max_group_slots=0), events, packed=packed)
    assert torch.equal(on, off)
    zero = uniform_members(batch, rewards)
    ran = set(counted.score_passes())
    assert ran == {t.traj_id for t in batch} - zero
    assert set(counted_off.score_passes()) == {t.traj_id for t in batch}
    assert result.num_skipped == len(zero)


def test_reward_free_terms_still_run_for_a_zero_advantage():
    """A KL or entropy term does not vanish with the advantage: such a trajectory still runs."""
    rng, batch, rewards = make(33000)
    rewards = [0.0] * len(batch)  # every group uniform
    model = small_model("float64")
    objective = GRPOObjective(kl_coef=0.05)
    events = gapped_event_order(rng, len(batch))
    streamed, result, counted = run_case(model, batch, rewards, objective, LedgerConfig(max_group_slots=0), events,
                                         packed=False)
    assert result.num_skipped == 0 and {tid for tid, _, _ in counted.calls} == {t.traj_id for t in batch}
    assert rel_err(streamed, kept_reference(model, batch, rewards, objective, None)) <= 1e-10


@pytest.mark.parametrize("seed", range(12))
def test_deferred_uniform_groups_run_nothing_and_mixed_ones_write_s_alone_first(model64, seed):
    """K unbounded: without deferring every rewarded trajectory runs its slot pass at once, uniform
    groups included; with it a uniform group runs nothing, and a mixed group's trajectories
    waiting for its first differing reward run at that reward, before it, so that only passes
    after the shift's reward write R."""
    rng, batch, rewards = make(34000 + seed)
    objective = GRPOObjective()
    events = gapped_event_order(rng, len(batch))
    eager, _, counted_eager = run_case(model64, batch, rewards, objective, LedgerConfig(defer_uniform_groups=False),
                                       events, packed=False)
    lazy, result, counted = run_case(model64, batch, rewards, objective, LedgerConfig(defer_uniform_groups=True),
                                     events, packed=False)
    assert rel_err(lazy, eager) <= 1e-10
    zero = uniform_members(batch, rewards)
    assert set(counted.score_passes()) == {t.traj_id for t in batch} - zero
    uniform = [members for _, members in batch_plan(batch) if len({rewards[i] for i in members}) == 1]
    # eager: a slot pass each but the last, which closes the group (direct, A = 0: skipped)
    assert len(set(counted_eager.score_passes()) & zero) == sum(len(m) - 1 for m in uniform)
    # The event log: the first differing reward of a mixed group releases its waiting members, in
    # sample order, before its own pass.
    log = [(kind, ident) for _, kind, ident in counted.ledger_events]
    for gid, members in batch_plan(batch):
        if len({rewards[i] for i in members}) == 1:
            continue
        order = [ident for kind, ident in log if kind == "reward" and ident in members]
        first = rewards[order[0]]
        trigger = next(i for i in order if rewards[i] != first)
        if trigger == order[-1]:
            continue  # the group closed at it: all direct
        at = log.index(("reward", trigger))
        waited = [i for i in order[:order.index(trigger)]]
        passes = [ident for kind, ident in log[at + 1:] if kind.startswith("backward:")][:len(waited) + 1]
        assert passes == [i for i in members if i in waited] + [trigger], (gid, log)
