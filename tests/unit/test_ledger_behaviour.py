"""Ledger behaviour beyond equality: exact zeros, DAPO drops, memory bound, data parallel, steps."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from megathunder.streaming import synthetic as syn

from megathunder.trajectory import batch_plan
from megathunder.config import GRPOObjective, LedgerConfig
from megathunder.objectives import num_loss_tokens
from megathunder.streaming.reference import reference_gradient
from megathunder.streaming import GradientLedger, TorchBackend
from tests.helpers import VOCAB, MAX_LEN, make_case, rel_err, small_model, streamed_gradient


@pytest.mark.parametrize("slots", [0, None])
@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "batch_std"])
def test_all_equal_reward_group_contributes_exactly_zero(slots, advantage):
    model = small_model("float32")
    rng = random.Random(21)
    batch = syn.random_batch(rng, [5], VOCAB, MAX_LEN, torch.float32, empty_prob=0.0)
    rewards = [0.1] * 5  # 5 * 0.1 is not exactly 0.5 in floating point; the shifted mean is exact
    objective = GRPOObjective(advantage=advantage)
    ref = reference_gradient(model, batch, rewards, objective)
    streamed, _, _ = streamed_gradient(
        model, batch, rewards, objective, LedgerConfig(max_group_slots=slots),
        syn.random_event_order(rng, 5),
    )
    assert torch.count_nonzero(ref) == 0
    assert torch.count_nonzero(streamed) == 0


@pytest.mark.parametrize("slots", [0, 1, None])
def test_dapo_dropped_group_changes_neither_gradient_nor_normaliser(slots):
    """Adding a group with equal rewards (dropped by dynamic sampling) changes no bit."""
    model = small_model("float32")
    objective = GRPOObjective(
        dapo_dynamic_sampling=True, kl_coef=0.1, entropy_coef=0.01, loss_agg="token_mean"
    )
    rng, batch, rewards = make_case(22, torch.float32, "continuous")
    events = syn.random_event_order(rng, len(batch))
    base, base_result, _ = streamed_gradient(
        model, batch, rewards, objective, LedgerConfig(max_group_slots=slots), events
    )
    extra = syn.random_batch(rng, [4], VOCAB, MAX_LEN, torch.float32)
    first_id = len(batch)
    for k, t in enumerate(extra):
        t.traj_id, t.group_id = first_id + k, 99
    # Interleave the dropped group's events with the others'.
    extra_events = [syn.Event(e.kind, e.traj_id + first_id) for e in syn.random_event_order(rng, 4)]
    merged = list(events)
    for e in extra_events:
        merged.insert(rng.randint(0, len(merged)), e)
    merged = _causal(merged)
    with_dropped, result, _ = streamed_gradient(
        model, batch + extra, rewards + [2.0] * 4, objective, LedgerConfig(max_group_slots=slots), merged
    )
    assert result.num_dropped_groups == base_result.num_dropped_groups + 1
    assert result.normaliser == base_result.normaliser
    if slots is None:  # the dropped group takes no slot from anyone: same operations, same bits
        assert torch.equal(with_dropped, base)
    else:
        assert rel_err(with_dropped, base) <= 1e-6


def _causal(events):
    """Move each reward after its trajectory's finish (random insertion may break causality)."""
    out, finished, waiting = [], set(), {}
    for e in events:
        if e.kind == "finished":
            out.append(e)
            finished.add(e.traj_id)
            if e.traj_id in waiting:
                out.append(waiting.pop(e.traj_id))
        elif e.traj_id in finished:
            out.append(e)
        else:
            waiting[e.traj_id] = e
    return out


@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("advantage,per_slot", [("grpo", 2), ("rloo", 1), ("dr_grpo", 1)])
def test_peak_memory_is_per_slot_buffers_plus_one(slots, advantage, per_slot):
    """With every group open at once and >= 2 distinct rewards processed per group, the ledger
    holds exactly per_slot * K + 1 parameter-sized buffers at its peak, never more."""
    model = small_model("float32")
    rng = random.Random(23)
    batch = syn.random_batch(rng, [4] * 5, VOCAB, MAX_LEN, torch.float32, empty_prob=0.0)
    rewards = [float(i % 2) for i in range(len(batch))]
    # Round-robin over groups: every group opens before any closes.
    order = sorted(range(len(batch)), key=lambda i: (i % 4, i // 4))
    events = [syn.Event(k, i) for i in order for k in ("finished", "reward")]
    objective = GRPOObjective(advantage=advantage)
    streamed, result, ledger = streamed_gradient(
        model, batch, rewards, objective, LedgerConfig(max_group_slots=slots), events
    )
    assert result.peak_buffers == per_slot * slots + 1
    assert ledger.pool.num_allocated == per_slot * slots + 1
    assert rel_err(streamed, reference_gradient(model, batch, rewards, objective)) <= 1e-5


def test_single_processed_trajectory_holds_one_buffer():
    model = small_model("float32")
    rng = random.Random(24)
    batch = syn.random_batch(rng, [3, 3], VOCAB, MAX_LEN, torch.float32, empty_prob=0.0)
    events = [syn.Event("finished", i) for i in range(6)] + [syn.Event("reward", i) for i in (0, 3)]
    for defer, live in ((False, 1 + 2), (True, 1)):  # P + one S per group, no R yet; deferred: P alone
        backend = TorchBackend(model, GRPOObjective())
        ledger = GradientLedger(backend, GRPOObjective(), LedgerConfig(max_group_slots=None, defer_uniform_groups=defer))
        ledger.begin_batch(batch_plan(batch))
        for e in events:
            (ledger.on_finished(batch[e.traj_id]) if e.kind == "finished" else ledger.on_reward(e.traj_id, 1.0))
        assert ledger.pool.num_live == live


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "batch_std"])
def test_data_parallel_ranks_sum_to_the_global_gradient(advantage):
    """Two ledgers, each owning half of every group, see all rewards: their sum is the reference."""
    model = small_model("float64")
    objective = GRPOObjective(advantage=advantage, kl_coef=0.05, dapo_dynamic_sampling=True)
    rng, batch, rewards = make_case(25, torch.float64, "binary")
    events = syn.random_event_order(rng, len(batch))
    owner = {t.traj_id: rng.randrange(2) for t in batch}
    grads = []
    for rank in range(2):
        backend = TorchBackend(model, objective)
        ledger = GradientLedger(backend, objective, LedgerConfig(max_group_slots=1))
        ledger.begin_batch(batch_plan(batch))
        syn.feed_events(ledger, batch, rewards, events, owner=lambda t: owner[t.traj_id] == rank,
                        num_loss_tokens=lambda t: num_loss_tokens(t, objective))
        ledger.close_batch()
        grads.append(backend.live.flat().clone())
    reference = reference_gradient(model, batch, rewards, objective)
    assert rel_err(grads[0] + grads[1], reference) <= 1e-10


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_parameters_after_one_step_match(optimizer, dtype):
    objective = GRPOObjective(kl_coef=0.05, entropy_coef=0.01)
    rng, batch, rewards = make_case(26, getattr(torch, dtype), "continuous")
    model_ref = small_model(dtype)
    model_stream = copy.deepcopy(model_ref)
    grad_ref = reference_gradient(model_ref, batch, rewards, objective)
    params = list(model_ref.parameters())
    start = 0
    for p in params:
        p.grad = grad_ref[start : start + p.numel()].view_as(p).clone()
        start += p.numel()
    streamed_gradient(
        model_stream, batch, rewards, objective, LedgerConfig(max_group_slots=2),
        syn.random_event_order(rng, len(batch)),
    )
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
    }[optimizer]
    before = torch.cat([p.detach().reshape(-1) for p in params])
    make(params).step()
    make(list(model_stream.parameters())).step()
    after_ref = torch.cat([p.detach().reshape(-1) for p in params])
    after_stream = torch.cat([p.detach().reshape(-1) for p in model_stream.parameters()])
    compared = torch.ones_like(grad_ref, dtype=torch.bool)
    if optimizer == "adamw":
        # Adam's first step is ~lr * sign(g): compare where |g| is far from the noise floor.
        compared = grad_ref.abs() > {"float32": 1e-5, "float64": 1e-12}[dtype] * grad_ref.abs().max()
    step_ref = after_ref[compared] - before[compared]
    step_stream = after_stream[compared] - before[compared]
    assert step_ref.norm() > 0
    assert rel_err(step_stream, step_ref) <= {"float32": 1e-4, "float64": 1e-10}[dtype]
