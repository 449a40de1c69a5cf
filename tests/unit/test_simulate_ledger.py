"""The simulator's thunder learner held to its ledger (``megathunder.simulate.ledger_model``):
the paths it gives each trajectory are the real ledger's, event by event, on one rank and per
rank under data parallelism; each call and buffer operation costs what its closed form says; with
every cost at zero it is the work-conserving queue the simulator had before."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from megathunder.config import GRPOObjective, LedgerConfig
from megathunder.objectives.advantages import advantage, group_stats
from megathunder.simulate.ledger_model import (
    CALL,
    DIRECT,
    OP,
    Costs,
    Job,
    LedgerRules,
    claim_owners,
    ledger_jobs,
    run_rank,
    zero_advantage,
)
from megathunder.simulate.learner_model import BACKWARD_SHARE


def _events(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct finish and reward times, each reward after its finish, interleaved at random."""
    rng = np.random.default_rng(seed)
    finish = rng.permutation(2 * n)[:n].astype(float)
    gap = rng.integers(1, 2 * n, size=n)
    reward = finish + gap + 0.5  # never a finish's time: every event at a distinct time
    return finish, reward


def _real_paths(batch, rewards, cfg: LedgerConfig, owner: np.ndarray, dp: int, finish, reward):
    """Feed two (or one) real ledgers the events in time order; per trajectory, (path, event time)
    of its score backward and of its pending buffer's fold."""
    from megathunder.streaming import GradientLedger, TorchBackend
    from megathunder.trajectory import batch_plan
    from tests.helpers import small_model

    objective = GRPOObjective()
    ledgers = [GradientLedger(TorchBackend(small_model(), objective), objective, cfg) for _ in range(dp)]
    plan = batch_plan(batch)
    for led in ledgers:
        led.begin_batch(plan)
    events = sorted([(finish[i], 0, i) for i in range(len(batch))] + [(reward[i], 1, i) for i in range(len(batch))])
    seen: dict[tuple[int, str], float] = {}
    for t, kind, i in events:
        marks = [len(led.events) for led in ledgers]
        for d, led in enumerate(ledgers):
            if kind == 0:
                if owner[i] == d:
                    led.on_finished(batch[i])
                else:
                    led.on_remote_finished(i, int(batch[i].loss_mask.sum()))
            else:
                led.on_reward(i, rewards[i])
        for led, mark in zip(ledgers, marks, strict=True):
            for _, name, ident in led.events[mark:]:
                path = {"backward:slot": "slot", "backward:pending": "pending", "backward:direct": "direct",
                        "backward:direct+rf": "direct", "fold:pending->slot": "pending_fold",
                        "fold:pending->direct": "pending_fold"}.get(name)
                if path is not None:
                    seen[(ident, path)] = t
    for led in ledgers:
        led.close_batch()
    return seen


@pytest.mark.parametrize("seed,slots,pending,dp,kind,defer", [
    *((s, k, n, dp, "continuous", False) for s in range(3) for k in (0, 1, 2, None) for n in (0, 1, 3) for dp in (1, 2)),
    *((s, k, n, 1, "binary", defer) for s in range(3, 9) for k in (1, None) for n in (0, 3) for defer in (False, True)),
])
def test_paths_are_the_real_ledger_s_event_by_event(seed, slots, pending, dp, kind, defer):
    """Every trajectory's score backward (slot, pending or direct) and every pending fold happen at
    the event the real ledger runs them at, with K slots and ``max_pending`` buffers per rank and
    each rank's ledger seeing only its own trajectories' work (its slots taken by them); with binary
    rewards zero advantages run nothing in both, and with ``defer_uniform_groups`` a group takes
    its slot at its first differing reward in both."""
    from tests.helpers import make_case

    _, batch, rewards = make_case(seed, torch.float64, kind)
    n = len(batch)
    finish, reward = _events(n, seed)
    tokens = np.array([len(t.tokens) for t in batch])
    owner = claim_owners(finish, tokens, dp)
    cfg = LedgerConfig(max_group_slots=slots, max_pending=pending, defer_uniform_groups=defer)
    real = _real_paths(batch, rewards, cfg, owner, dp, finish, reward)

    group = np.empty(n, dtype=np.int64)
    for g, (_, ids) in enumerate(__import__("megathunder.trajectory", fromlist=["batch_plan"]).batch_plan(batch)):
        group[ids] = g
    rules = LedgerRules(max_slots=slots, pending=pending != 0, max_pending=pending, buffers_per_slot=2,
                        skip_zero=True, defer=defer)
    jobs = ledger_jobs(rules, group, finish, reward, np.ones(n), owner, dp, value=np.asarray(rewards, dtype=float))
    model = {(j.traj, j.path): j.ready for rank_jobs in jobs for j in rank_jobs if j.traj >= 0}
    assert model == real
    for d, rank_jobs in enumerate(jobs):  # each rank runs its own trajectories only
        assert all(owner[j.traj] == d for j in rank_jobs if j.traj >= 0)


@pytest.mark.parametrize("seed", range(8))
def test_zero_advantages_are_the_ones_the_real_advantage_gives(seed):
    """The simulator skips exactly the trajectories whose real GRPO advantage is 0.0. Rewards from
    a few values that are not binary fractions, so groups are often all equal and a plain mean
    misses them (0.1 + 0.1 + 0.1 over 3 is not 0.1), and a group's own reward can be its mean
    ({0.1, 0.1, 0.3, 0.7}); members of a group interleaved in sample order."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(2, 9, size=40)
    group = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))
    pick = rng.choice([0.1, 0.3, 0.7], size=len(sizes))
    value = np.where(rng.random(len(group)) < 0.5, pick[group], rng.choice([0.1, 0.3, 0.7], size=len(group)))
    cfg = GRPOObjective()
    expected = np.zeros(len(group), dtype=bool)
    for g in range(len(sizes)):
        ids = np.flatnonzero(group == g)
        stats = group_stats(value[ids].tolist(), cfg)
        expected[ids] = [advantage(float(value[i]), stats) == 0.0 for i in ids]
    assert expected.any() and not expected.all()
    assert zero_advantage(group, value).tolist() == expected.tolist()
    assert not zero_advantage(group, None).any()


def test_owners_are_the_least_loaded_rank_by_tokens_in_claim_order():
    owner = claim_owners(np.array([3.0, 1.0, 2.0, 0.0]), np.array([5, 10, 1, 4]), 2)
    # claim order 3 (4 tokens) -> r0, 1 (10) -> r1, 2 (1) -> r0 (4 < 10), 0 (5) -> r0 (5 < 10)
    assert owner.tolist() == [0, 1, 0, 0]


# -- costs in closed form ---------------------------------------------------------------------------

def test_a_lone_call_pays_the_fixed_cost_and_the_whole_pipeline():
    """A slot-path trajectory alone: one call of one micro-batch, F + p x work; direct work ready
    together goes in one packed call, F + sum x (m + p - 1) / m, and so do slot-path trajectories
    ready together (``ledger.pack_own_passes``; off: F + p x work each)."""
    costs = Costs(call_s=0.05)
    (lone,) = run_rank(0, [Job(1.0, CALL, work=2.0, writes=0)], 0.0, 2, costs, 64)
    assert (lone.start, lone.end) == (1.0, pytest.approx(1.0 + 0.05 + 2 * 2.0))
    packed = run_rank(0, [Job(1.0, DIRECT, work=w) for w in (1.0, 2.0, 3.0)], 0.0, 2, costs, 64)
    assert len(packed) == 1 and packed[0].end == pytest.approx(1.0 + 0.05 + 6.0 * 4 / 3)
    assert packed[0].last_backward_s == pytest.approx(BACKWARD_SHARE * 3.0)
    # slot-path trajectories ready together: one call too (``backward_each``), each its own gradient
    own = [Job(1.0, CALL, work=w, writes=0) for w in (1.0, 2.0, 3.0)]
    (call,) = run_rank(0, own, 0.0, 2, costs, 64)
    assert call.end == pytest.approx(1.0 + 0.05 + 6.0 * 4 / 3)
    alone = run_rank(0, own, 0.0, 2, Costs(call_s=0.05, pack_own=False), 64)
    assert len(alone) == 3 and alone[-1].end == pytest.approx(1.0 + 3 * 0.05 + 2 * 6.0)


def test_host_writes_block_the_learner_only_while_the_staging_buffer_is_busy():
    """Host slots, one staging buffer: a trajectory's S and R writes -- unpaired, R's staging copy
    waits for S's D2H and add; paired, one staging copy feeds both. The step waits for the last."""
    c = Costs(host=True, write_block_s=0.01, mover_s=0.5, mover_pair_s=0.8, paired=False, pack_own=False)
    spans = run_rank(0, [Job(0.0, CALL, work=1.0, writes=2), Job(0.0, CALL, work=1.0, writes=2)], 0.0, 1, c, 64)
    train = [s for s in spans if s.kind == "train"]
    # 1st: train [0, 1]; S copy to 1.01, mover to 1.51; R copy waits: 1.52, mover to 2.02
    # 2nd: train [1.52, 2.52]; S waits for nothing (2.02 < 2.52): 2.53, mover 3.03; R: 3.04, mover 3.54
    assert [(s.start, s.end) for s in train] == [(0.0, 1.0), (pytest.approx(1.52), pytest.approx(2.52))]
    assert max(s.end for s in spans) == pytest.approx(3.54)
    # the same two in one call (ledger.pack_own_passes): each one's writes right after its own
    # backward, so the same times; one compute span [0, 2], the writes' blocking after it
    c = Costs(host=True, write_block_s=0.01, mover_s=0.5, mover_pair_s=0.8, paired=False)
    spans = run_rank(0, [Job(0.0, CALL, work=1.0, writes=2), Job(0.0, CALL, work=1.0, writes=2)], 0.0, 1, c, 64)
    assert [(s.start, s.end) for s in spans if s.kind == "train"] == [(0.0, 2.0)]
    assert max(s.end for s in spans) == pytest.approx(3.54)
    paired = run_rank(0, [Job(0.0, CALL, work=1.0, writes=2), Job(0.0, CALL, work=1.0, writes=2)], 0.0, 1,
                      Costs(host=True, write_block_s=0.01, mover_s=0.5, mover_pair_s=0.8, paired=True), 64)
    # 1st: [0, 1], copy to 1.01, mover to 1.81; 2nd: [1.01, 2.01], copy to 2.02, mover 2.82
    assert max(s.end for s in paired) == pytest.approx(2.82)


def test_folds_wait_for_the_mover_and_block_the_learner():
    c = Costs(host=True, write_block_s=0.0, mover_s=1.0, fold_s=0.3, slot_add_s=0.2)
    spans = run_rank(0, [Job(0.0, CALL, work=1.0, writes=1), Job(1.0, OP, ops=2, op="fold"),
                         Job(1.0, OP, ops=1, op="slot_add")], 0.0, 1, c, 64)
    # train [0, 1]; mover busy to 2; folds wait for it: 2 + 0.6; the slot add then 2.6 + 0.2
    assert max(s.end for s in spans) == pytest.approx(2.8)
    device = run_rank(0, [Job(0.0, CALL, work=1.0, writes=1), Job(1.0, OP, ops=2, op="fold")], 0.0, 1,
                      Costs(write_block_s=0.1, fold_s=0.3), 64)
    assert max(s.end for s in device) == pytest.approx(1.0 + 0.1 + 0.6)


def test_buffer_costs_follow_the_profile_s_placement_and_rates():
    """Per buffer of B fp32 elements: device ops are their bytes over the device's rate; a host
    write is 8 B bytes of staging copy, then 4 B bytes of D2H and B elements of host add -- in
    sequence, or with chunks overlapped (the longer plus one chunk of the shorter)."""
    from tests.unit.test_simulate import tiny

    p = tiny(ledger={"costs": True, "buffer_params": 1e9, "placement": "device"},
             buffers={"device_gb_per_s": 1000.0, "d2h_gb_per_s": 20.0, "h2d_gb_per_s": 10.0,
                      "host_add_elements_per_s": [[1, 1e9], [4, 2e9]]})
    dev = Costs.of(p)
    assert not dev.host and dev.write_block_s == pytest.approx(12e9 / 1e12) and dev.fold_s == pytest.approx(12e9 / 1e12)
    host = Costs.of(p.with_overrides({"ledger": {"placement": "host", "host_threads": 4, "host_chunk_mb": 0}}))
    assert host.host and host.write_block_s == pytest.approx(8e9 / 1e12)
    assert host.mover_s == pytest.approx(4e9 / 20e9 + 1e9 / 2e9)  # 0.2 s D2H + 0.5 s add
    assert host.mover_pair_s == pytest.approx(0.2 + 1.0)
    assert host.fold_s == pytest.approx(4e9 / 10e9 + 12e9 / 1e12)
    chunked = Costs.of(p.with_overrides({"ledger": {"placement": "host", "host_threads": 4, "host_chunk_mb": 256}}))
    chunks = np.ceil(4e9 / (256 * 2**20))
    assert chunked.mover_s == pytest.approx(0.5 + 0.2 / chunks)
    one = Costs.of(p.with_overrides({"ledger": {"placement": "host", "host_threads": 1, "host_chunk_mb": 0}}))
    assert one.mover_s == pytest.approx(0.2 + 1.0)
    assert Costs.of(p.with_overrides({"ledger": {"costs": False}})) == Costs(call_s=p.learner.call_overhead_s)


@pytest.mark.parametrize("seed", range(4))
def test_with_no_costs_one_rank_is_the_old_work_conserving_queue(seed):
    """dp = 1, p = 1, every cost zero: the rank ends when a work-conserving server of the ready
    times ends, whatever the paths (the model before costs: ``max over i of ready_i + work after``)."""
    rng = random.Random(seed)
    n = 24
    group = np.repeat(np.arange(6), 4)
    finish, reward = _events(n, seed)
    work = np.array([rng.uniform(0.1, 3.0) for _ in range(n)])
    jobs = ledger_jobs(LedgerRules(max_slots=2), group, finish, reward, work, np.zeros(n, np.int64), 1)
    end = max(s.end for s in run_rank(0, jobs[0], 0.0, 1, Costs(), 64))
    ready = np.array(sorted((j.ready, j.work) for j in jobs[0] if j.kind != OP))
    expect = 0.0
    for t, w in ready:
        expect = max(expect, t) + w
    assert end == pytest.approx(expect)
    assert sorted(j.work for j in jobs[0] if j.kind != OP) == pytest.approx(sorted(work))
