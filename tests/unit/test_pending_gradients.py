"""Gradients before the reward (``ledger.max_pending``): h_i computed when a trajectory finishes,
kept in a pending buffer and folded in when its reward arrives, without a new backward.

The update is the batch-synchronous one (fp64, 1e-10 relative) for every advantage, aggregation,
K and pending limit, under random event orders with varying finish-to-reward gaps, with failed
trajectories (``hold_groups_until_close``), DAPO dynamic sampling, KL/entropy, refill groups
(``add_group``) and ready-work packing (``hold`` / ``release``). Each trajectory's score backward
runs once, at finish whenever a pending buffer was free, and the slot and pending buffers together
never exceed ``ledger.slot_budget_gb``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest
import torch

from megathunder.config import GRPOObjective, LedgerConfig
from megathunder.objectives import coef_known_before_close
from megathunder.streaming import GradientLedger, TorchBackend
from megathunder.streaming import synthetic as syn
from megathunder.streaming.buffers import pending_within_budget
from megathunder.streaming.reference import reference_gradient
from megathunder.trajectory import Trajectory, batch_plan
from tests.helpers import make_case, rel_err, small_model
from tests.unit.test_streaming_exact import (
    ADVANTAGES,
    AGGREGATIONS,
    SLOTS,
    events_with_added_groups,
    random_objective,
    summing_backend,
)

PENDING = ["off", "capped", "unbounded"]
GRID = list(itertools.product(ADVANTAGES, AGGREGATIONS, SLOTS, PENDING))  # 192 cases
REWARD_KINDS = ["binary", "continuous", "large_offset", "equal"]


def pending_limit(rng: random.Random, kind: str) -> int | None:
    return {"off": 0, "capped": rng.randint(1, 3), "unbounded": None}[kind]


def gapped_event_order(rng: random.Random, num_trajs: int) -> list[syn.Event]:
    """Random causal interleaving whose finish-to-reward gaps vary from case to case: with a high
    ``p_finish`` most trajectories finish long before any verifier returns, with a low one each
    reward follows its finish closely."""
    p_finish = rng.choice([0.15, 0.5, 0.85])
    todo = list(range(num_trajs))
    rng.shuffle(todo)
    finished: list[int] = []
    order: list[syn.Event] = []
    while todo or finished:
        if todo and (not finished or rng.random() < p_finish):
            tid = todo.pop()
            order.append(syn.Event("finished", tid))
            finished.append(tid)
        else:
            order.append(syn.Event("reward", finished.pop(rng.randrange(len(finished)))))
    return order


class CountingBackend:
    """Wraps a backend; records every pass: (trajectory, advantage of each spec, reward known?)."""

    def __init__(self, inner: TorchBackend) -> None:
        self.inner = inner
        self.rewarded: set[int] = set()
        self.calls: list[tuple[int, list[float | None], bool]] = []
        if hasattr(inner, "backward_sum"):
            self.backward_sum = self._backward_sum

    def zeros(self):
        return self.inner.zeros()

    def load_grad(self, grad):
        self.inner.load_grad(grad)

    def backward(self, traj, specs):
        self.calls.append((traj.traj_id, [s.advantage for s in specs], traj.traj_id in self.rewarded))
        return self.inner.backward(traj, specs)

    def _backward_sum(self, trajs, specs):
        for traj, spec in zip(trajs, specs, strict=True):
            self.calls.append((traj.traj_id, [spec.advantage], traj.traj_id in self.rewarded))
        return self.inner.backward_sum(trajs, specs)

    def score_passes(self) -> dict[int, list[tuple[float, bool]]]:
        out: dict[int, list[tuple[float, bool]]] = {}
        for tid, advantages, rewarded in self.calls:
            for a in advantages:
                if a is not None:
                    out.setdefault(tid, []).append((a, rewarded))
        return out


def run_case(model, batch: Sequence[Trajectory], rewards: Sequence[float], objective, ledger_cfg: LedgerConfig,
             events, *, packed: bool, queued: Sequence[bool] | None = None, failed: int | None = None,
             first_added: int | None = None):
    """Feed one batch through a ledger; returns (gradient, BatchResult, CountingBackend)."""
    inner = summing_backend(model, objective) if packed else TorchBackend(model, objective)
    backend = CountingBackend(inner)
    ledger = GradientLedger(backend, objective, ledger_cfg)
    plan = batch_plan(batch)
    ledger.begin_batch(plan if first_added is None else plan[:first_added])
    if first_added is not None:
        events = events_with_added_groups(random.Random(len(events)), batch, events, first_added)
    by_id = {t.traj_id: t for t in batch}
    k = 0
    for ev in events:
        if isinstance(ev, tuple):  # ("add", group)
            ledger.add_group(ev[1], dict(plan)[ev[1]])
            continue
        more = queued is not None and queued[k]
        k += 1
        if more:
            ledger.hold()
        if ev.kind == "reward":
            backend.rewarded.add(ev.traj_id)
            ledger.on_reward(ev.traj_id, None if ev.traj_id == failed else rewards[ev.traj_id])
        else:
            ledger.on_finished(by_id[ev.traj_id])
        if not more:
            ledger.release()
    result = ledger.close_batch()
    backend.ledger_events = ledger.events
    return inner.live.flat().clone(), result, backend


def kept_reference(model, batch, rewards, objective, failed: int | None) -> torch.Tensor | None:
    """The reference on the groups without a failed trajectory (None if no group is left)."""
    failed_group = None if failed is None else batch[failed].group_id
    kept = [(t, r) for t, r in zip(batch, rewards, strict=True) if t.group_id != failed_group]
    if not kept:
        return None
    return reference_gradient(model, [t for t, _ in kept], [r for _, r in kept], objective)


@pytest.fixture(scope="module")
def model64():
    return small_model("float64")


@pytest.mark.parametrize("case", range(len(GRID)))
def test_pending_gradients_give_the_batch_update_fp64(model64, case):
    advantage, loss_agg, slots, pending = GRID[case]
    rng, batch, rewards = make_case(21000 + case, torch.float64, REWARD_KINDS[case % 4])
    objective = random_objective(rng, advantage, loss_agg)
    hold = rng.random() < 0.4
    ledger_cfg = LedgerConfig(
        max_group_slots=slots, max_pending=pending_limit(rng, pending), hold_groups_until_close=hold,
        reward_free_terms=rng.choice(["with_score", "at_finish"]),
        slot_placement=rng.choice(["device", "device", "host"]),
    )
    failed = rng.randrange(len(batch)) if hold and rng.random() < 0.6 else None
    plan = batch_plan(batch)
    first_added = rng.randint(1, len(plan) - 1) if objective.dapo_dynamic_sampling and rng.random() < 0.5 else None
    events = gapped_event_order(rng, len(batch))
    packed = rng.random() < 0.5
    queued = [rng.random() < 0.6 for _ in events] if packed else None
    streamed, result, _ = run_case(model64, batch, rewards, objective, ledger_cfg, events, packed=packed,
                                   queued=queued, failed=failed, first_added=first_added)
    reference = kept_reference(model64, batch, rewards, objective, failed)
    if reference is None:
        assert result.num_kept_groups == 0 and streamed.abs().max() == 0
        return
    assert rel_err(streamed, reference) <= 1e-10, (objective, ledger_cfg, failed, first_added, packed)
    if pending == "off":
        assert result.peak_pending == 0 and result.num_pending_backward == 0
    elif pending == "capped":
        assert result.peak_pending <= ledger_cfg.max_pending


@pytest.mark.parametrize("case", range(48))
def test_each_score_backward_runs_once_and_at_finish_when_a_buffer_is_free(model64, case):
    """Counting passes: every kept trajectory's score term comes from exactly one backward. A
    trajectory that finishes while a pending buffer is free gets it at once (A = -1, before its
    reward); with unbounded pending buffers that is every trajectory. Every other one runs as
    without pending buffers (at its reward, or later in a buffer freed meanwhile)."""
    advantage, loss_agg, slots, _ = GRID[case * 4 % len(GRID)]
    pending = ["capped", "unbounded"][case % 2]
    rng, batch, rewards = make_case(23000 + case, torch.float64, REWARD_KINDS[case % 4])
    objective = random_objective(rng, advantage, loss_agg)
    hold = rng.random() < 0.3
    ledger_cfg = LedgerConfig(max_group_slots=slots, max_pending=pending_limit(rng, pending),
                              hold_groups_until_close=hold)
    events = gapped_event_order(rng, len(batch))
    packed = rng.random() < 0.5
    streamed, result, backend = run_case(model64, batch, rewards, objective, ledger_cfg, events, packed=packed)
    assert rel_err(streamed, kept_reference(model64, batch, rewards, objective, None)) <= 1e-10
    passes = backend.score_passes()
    assert all(len(p) == 1 for p in passes.values()), passes  # never a second score backward
    kept_groups = {gid for gid, members in batch_plan(batch)
                   if not (objective.dapo_dynamic_sampling and len({rewards[i] for i in members}) == 1)}
    log = [(kind, ident) for _, kind, ident in backend.ledger_events]
    skipped = {ident for kind, ident in log if kind == "skip:zero-advantage"}  # A = 0: nothing to run
    assert len(skipped) == result.num_skipped and not skipped & set(passes)
    for t in batch:
        if t.group_id in kept_groups:
            assert t.traj_id in passes or t.traj_id in skipped, f"trajectory {t.traj_id}: its score term never ran"
    # Replay the ledger's log: the pending buffers live at each finish, and the pass that follows.
    pending_passes = {ident for kind, ident in log if kind.startswith("backward:") and "pending" in kind}
    assert len(pending_passes) == result.num_pending_backward
    assert all(passes[tid][0] == (-1.0, False) for tid in pending_passes)  # A = -1, before the reward
    live, at_finish = 0, set()
    for i, (kind, ident) in enumerate(log):
        if kind == "finished":
            if ledger_cfg.max_pending is None or live < ledger_cfg.max_pending:
                assert log[i + 1][0].startswith("backward:pending") and log[i + 1][1] == ident, log[i:i + 2]
                at_finish.add(ident)
        elif kind.startswith("backward:pending"):
            live += 1
        elif kind == "pending:freed":  # folded or discarded
            live -= 1
        assert ledger_cfg.max_pending is None or live <= ledger_cfg.max_pending
    assert live == 0
    assert all(not passes[tid][0][1] for tid in at_finish)  # before the reward
    if pending == "unbounded":
        assert at_finish == {t.traj_id for t in batch}, "every trajectory's h_i at finish"
    assert result.peak_pending <= (len(batch) if ledger_cfg.max_pending is None else ledger_cfg.max_pending)


def test_pending_off_is_bitwise_the_reward_time_path(model64):
    """``max_pending: 0`` (the default) changes nothing: the same passes and the same bits."""
    objective = GRPOObjective(advantage="grpo", kl_coef=0.05, entropy_coef=0.01, dapo_dynamic_sampling=True)
    rng, batch, rewards = make_case(24000, torch.float64, "binary")
    events = gapped_event_order(rng, len(batch))
    default, _, b0 = run_case(model64, batch, rewards, objective, LedgerConfig(max_group_slots=1), events,
                              packed=False)
    off, result, b1 = run_case(model64, batch, rewards, objective, LedgerConfig(max_group_slots=1, max_pending=0),
                               events, packed=False)
    assert LedgerConfig().max_pending == 0
    assert torch.equal(default, off) and b0.calls == b1.calls and result.peak_pending == 0


@pytest.mark.parametrize("case", range(24))
def test_slot_and_pending_buffers_never_exceed_the_budget(model64, case):
    """One budget for both: K slots at their largest are reserved first, pending buffers get the
    rest; the pool's peak (minus the accumulators P, P_A) stays within it, and the pending
    buffers are used (the bound is not vacuous)."""
    advantage = ADVANTAGES[case % 4]
    rng, batch, rewards = make_case(25000 + case, torch.float64, REWARD_KINDS[case % 4])
    objective = random_objective(rng, advantage, rng.choice(AGGREGATIONS))
    hold = case % 3 == 0
    per_slot = 1 if coef_known_before_close(objective) and not hold else 2
    buffer_bytes = sum(p.numel() for p in model64.parameters()) * 8
    slots = rng.choice([0, 1, 2])
    budget_buffers = slots * per_slot + rng.randint(1, 3)
    ledger_cfg = LedgerConfig(max_group_slots=slots, max_pending=None, hold_groups_until_close=hold,
                              slot_budget_gb=budget_buffers * buffer_bytes / 2**30)
    events = gapped_event_order(rng, len(batch))
    streamed, result, _ = run_case(model64, batch, rewards, objective, ledger_cfg, events, packed=case % 2 == 1)
    assert rel_err(streamed, kept_reference(model64, batch, rewards, objective, None)) <= 1e-10
    accumulators = 2 if advantage == "batch_std" else 1
    assert result.max_group_slots == slots
    assert result.max_pending == budget_buffers - slots * per_slot
    assert result.peak_buffers - accumulators <= budget_buffers
    assert result.peak_device_bytes <= (budget_buffers + accumulators) * buffer_bytes
    assert 1 <= result.peak_pending <= result.max_pending


def test_peak_buffers_count_the_pending_ones(model64):
    """K = 0 (no slot buffer ever), unbounded pending, every trajectory finishing before any
    reward: the peak is P plus one pending buffer per trajectory."""
    objective = GRPOObjective(advantage="grpo")
    _, batch, rewards = make_case(26000, torch.float64, "continuous")
    events = [syn.Event("finished", t.traj_id) for t in batch] + [syn.Event("reward", t.traj_id) for t in batch]
    streamed, result, backend = run_case(model64, batch, rewards, objective,
                                         LedgerConfig(max_group_slots=0, max_pending=None), events, packed=False)
    assert rel_err(streamed, reference_gradient(model64, batch, rewards, objective)) <= 1e-10
    assert result.peak_pending == len(batch) and result.peak_buffers == 1 + len(batch)
    assert len(backend.calls) == len(batch)  # no pass after any reward


def test_pending_within_budget():
    gib = 2**30
    assert pending_within_budget(0, 3, 1.0, gib // 8, 2) == 0  # off stays off
    assert pending_within_budget(None, 5, None, 100, 2) is None  # no budget: the cap alone
    assert pending_within_budget(4, 5, None, 100, 2) == 4
    assert pending_within_budget(None, 3, 1.0, gib // 8, 2) == 2  # 8 buffers fit, 6 for K = 3
    assert pending_within_budget(1, 3, 1.0, gib // 8, 2) == 1
    assert pending_within_budget(None, 4, 1.0, gib // 8, 2) == 0  # K took the whole budget


def test_max_pending_config_is_checked_by_name():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_pending"):
        LedgerConfig(max_pending=-1)
