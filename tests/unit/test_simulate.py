"""The schedule simulator: closed-form cases, invariants, bounds, and the ledger's slot rule."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from megathunder.config import GRPOObjective, LedgerConfig
from megathunder.simulate import sim_metrics as metrics
from megathunder.simulate.ledger_model import LedgerRules, claim_owners, ledger_jobs
from megathunder.simulate.learner_model import (
    burst_s,
    train_batch,
    update_tail_s,
)
from megathunder.simulate.profile import Profile
from megathunder.simulate.rollout_model import RolloutCluster
from megathunder.simulate.schedule_model import (
    run_async,
    run_fully_async,
    run_sync,
    run_thunder,
    sample_batches,
    simulate,
)
from megathunder.simulate.workload import sample_batch


def const(v: float) -> dict:
    return {"kind": "constant", "value": v}


def tiny(**over) -> Profile:
    """A small cluster; constant everything unless overridden. One engine, one learner rank."""
    data = {
        "name": "tiny",
        "model": {"num_params": 1e9, "num_layers": 4, "hidden_size": 256},
        "cluster": {"num_rollout_gpus": 1, "num_learner_gpus": 1, "peak_flops_per_gpu": 1e15},
        "rollout": {"max_num_seqs": 64, "decode_tokens_per_s": [[1, 100], [6, 300]],
                    "prefill_tokens_per_s": 1000},
        "learner": {"seconds_per_token": 0.01, "optimizer_step_s": 1.0, "weight_sync_s": 2.0,
                    "layerwise_overlap": False},
        "ledger": {"costs": False},  # buffer operations free: the schedules' own timing (costs: below)
        "workload": {"num_prompts_per_batch": 2, "samples_per_prompt": 3,
                     "prompt_tokens": const(200), "turns": const(2), "tokens_per_turn": const(100),
                     "observation_tokens_per_turn": const(50), "tool_latency_s": const(1.0),
                     "verifier_latency_s": const(0.5), "max_context_tokens": 100000},
        "run": {"num_steps": 3, "warmup_steps": 1, "seed": 0},
    }
    return Profile.model_validate(data).with_overrides(over)


def varied(seed: int = 0, **over) -> Profile:
    """Long-tailed lengths and latencies on 2 engines with a KV cap, 4 groups of 4."""
    base = {
        "rollout": {"max_num_seqs": 5, "tensor_parallel": 1},
        "cluster": {"num_rollout_gpus": 2},
        "workload": {
            "num_prompts_per_batch": 4, "samples_per_prompt": 4,
            "turns": {"kind": "lognormal", "median": 4, "sigma": 0.8, "min": 1, "max": 30},
            "tokens_per_turn": {"kind": "lognormal", "median": 80, "sigma": 0.7, "min": 1},
            "observation_tokens_per_turn": {"kind": "lognormal", "median": 100, "sigma": 1.0},
            "tool_latency_s": {"kind": "lognormal", "median": 0.5, "sigma": 1.0},
            "verifier_latency_s": {"kind": "lognormal", "median": 2.0, "sigma": 0.5},
            "prompt_difficulty_share": 0.5,
        },
        "learner": {"seconds_per_token": 0.002},
        "run": {"seed": seed, "num_steps": 3},
    }
    return tiny(**base).with_overrides(over)


# -- closed forms ---------------------------------------------------------------------------------

def test_sync_step_is_rollout_plus_train_in_closed_form():
    p = tiny()
    # six trajectories in lockstep on one engine: each decodes at 300 / 6 = 50 tokens/s
    rollout = 200 / 1000 + 100 / 50 + 1.0 + 50 / 1000 + 100 / 50 + 0.5
    train = 6 * (200 + 2 * 100 + 50) * 0.01
    step = rollout + train + 1.0 + 2.0
    trace = run_sync(p, sample_batches(p, 3))
    ends = [s.end for s in trace.steps]
    assert ends == pytest.approx([step, 2 * step, 3 * step], rel=1e-12)
    assert trace.steps[0].rollout_wait_s == pytest.approx(rollout, rel=1e-12)
    assert metrics.summary(trace)["learner_idle_share"] == pytest.approx(rollout / step, rel=1e-9)


def test_thunder_equals_sync_when_all_rewards_arrive_together():
    p = tiny()
    batches = sample_batches(p, 3)
    sync, thunder = run_sync(p, batches), run_thunder(p, batches)
    assert [s.end for s in thunder.steps] == pytest.approx([s.end for s in sync.steps], rel=1e-12)


def test_processor_sharing_and_kv_cap_in_closed_form():
    p = tiny(rollout={"decode_tokens_per_s": [[1, 100], [2, 150]]},
             workload={"num_prompts_per_batch": 1, "samples_per_prompt": 2, "turns": const(1),
                       "verifier_latency_s": const(0.0), "prompt_tokens": const(0)})
    batch = sample_batch(p.workload, np.random.default_rng(0))
    batch = type(batch)(**{**batch.__dict__, "decode_tokens": np.array([100, 300])})
    c = RolloutCluster(p)
    c.add_batch(batch, 0.0)
    c.run()
    # together at 75 tokens/s each until the first ends (100 / 75 s), then 200 tokens at 100/s
    assert c.finish_time == pytest.approx([100 / 75, 100 / 75 + 2.0], rel=1e-12)
    assert c.decoded_tokens == pytest.approx(400, rel=1e-12)

    capped = RolloutCluster(p.with_overrides({"rollout": {"max_num_seqs": 1}}))
    capped.add_batch(batch, 0.0)
    capped.run()
    assert capped.finish_time == pytest.approx([1.0, 4.0], rel=1e-12)


def test_pipeline_bubble_and_layerwise_tail():
    assert burst_s(10.0, 4, 4) == pytest.approx(10.0 * 7 / 4)
    bursts = train_batch(np.array([3.0, 1.0, 2.0, 2.0]), num_ranks=2, p=1, t0=5.0)
    assert sorted(b.end for b in bursts) == pytest.approx([9.0, 9.0])  # 3+1 and 2+2
    p = tiny(learner={"layerwise_overlap": True, "optimizer_step_s": 3.0, "weight_sync_s": 3.0})
    L = p.model.num_layers
    assert update_tail_s(p, 3.0) == pytest.approx(9 / L + (L - 1) / L * 3 - 3)
    serial = p.with_overrides({"learner": {"layerwise_overlap": False}})
    assert update_tail_s(p, 3.0) < update_tail_s(serial, 3.0) == 6.0


# -- the ledger's slot rule -----------------------------------------------------------------------

def _groups_and_rewards(seed: int):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 7, size=rng.integers(2, 7))
    group = np.repeat(np.arange(len(sizes)), sizes)
    return group, rng.permutation(len(group)).astype(float)


def ledger_ready_times(group: np.ndarray, reward: np.ndarray, slots: int | None) -> np.ndarray:
    """When each trajectory's score gradient runs on one rank (``ledger_model.ledger_jobs``; each
    finishes just before its reward)."""
    jobs = ledger_jobs(LedgerRules(max_slots=slots), group, reward - 0.25, reward, np.ones(len(group)),
                       np.zeros(len(group), dtype=np.int64), 1)[0]
    ready = np.full(len(group), np.nan)
    for j in jobs:
        if j.traj >= 0:
            ready[j.traj] = j.ready
    return ready


@pytest.mark.parametrize("seed", range(5))
def test_slots_zero_is_group_level_and_unbounded_is_per_trajectory(seed):
    group, reward = _groups_and_rewards(seed)
    close = np.array([reward[group == g].max() for g in group])
    assert np.array_equal(ledger_ready_times(group, reward, 0), close)
    assert np.array_equal(ledger_ready_times(group, reward, None), reward)
    assert np.array_equal(ledger_ready_times(group, reward, int(group.max()) + 1), reward)
    for k in (1, 2):
        ready = ledger_ready_times(group, reward, k)
        assert np.all(reward <= ready) and np.all(ready <= close)


# -- schedules: staleness, ordering, bounds, invariants ---------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_staleness_by_schedule(seed):
    traces = simulate(varied(seed))
    for name in ("sync", "thunder"):
        assert all(s.staleness.max() == 0 for s in traces[name].steps)
    stale = [s.staleness for s in traces["async"].steps]
    assert stale[0].max() == 0 and all(np.all(s == 1) for s in stale[1:])
    fa = np.concatenate([s.staleness for s in traces["fully_async"].steps])
    assert fa.min() >= 0 and fa.max() >= 1


@pytest.mark.parametrize("seed,slots", [(s, k) for s in range(3) for k in (0, 1, None)])
def test_thunder_is_never_slower_than_sync_and_never_beats_the_bounds(seed, slots):
    p = varied(seed, schedules={"max_group_slots": slots})
    batches = sample_batches(p, p.run.num_steps)
    sync, thunder = run_sync(p, batches), run_thunder(p, batches)
    prev_s = prev_t = 0.0
    for s, t in zip(sync.steps, thunder.steps, strict=True):
        assert t.end - prev_t <= s.end - prev_s + 1e-9
        assert t.end - prev_t >= max(s.rollout_wait_s, s.learner_tail_s) - 1e-9
        assert t.end - prev_t >= s.arrival_bound_s - 1e-9
        prev_s, prev_t = s.end, t.end
    bound = metrics.overlap_bound(sync)
    ratio = metrics.zero_staleness_ratio(sync, thunder)
    assert 1 - 1e-12 <= ratio <= bound["B_arrival"] + 1e-9 <= bound["B"] + 2e-9
    if slots is None:  # per-trajectory streaming on one rank attains the arrival bound
        assert ratio == pytest.approx(bound["B_arrival"], rel=1e-12)


def test_fewer_slots_never_help():
    p = varied(1)
    batches = sample_batches(p, p.run.num_steps)
    ends = [run_thunder(p.with_overrides({"schedules": {"max_group_slots": k}}), batches).steps[-1].end
            for k in (0, 1, 2, None)]
    assert all(a >= b - 1e-9 for a, b in zip(ends, ends[1:], strict=False))
    assert ends[0] > ends[-1]


@pytest.mark.parametrize("runner", [run_sync, run_async, run_fully_async, run_thunder])
def test_busy_plus_idle_is_wall_and_work_is_conserved(runner):
    p = varied(2, learner={"layerwise_overlap": True, "pipeline_parallel": 1})
    batches = sample_batches(p, p.run.num_steps + 4)
    trace = runner(p, batches if runner is run_fully_async else batches[: p.run.num_steps])
    lanes = metrics.merged_lanes(trace)
    for row in metrics.step_table(trace):
        wall = row["end_s"] - row["start_s"]
        assert wall > 0
        busy = metrics.busy_s(lanes, "learner", row["start_s"], row["end_s"])
        idle = p.num_dp * wall - busy
        assert 0 <= busy <= p.num_dp * wall + 1e-9 and busy + idle == pytest.approx(p.num_dp * wall)
        assert 0 <= row["rollout_busy_share"] <= 1 + 1e-12
    for lane in (ln for ln in {iv.lane for iv in trace.intervals} if ln.startswith("learner")):
        train = sorted((iv.start, iv.end) for iv in trace.intervals if iv.lane == lane and iv.kind == "train")
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(train, train[1:], strict=False))  # one at a time
    if runner is not run_fully_async:
        decoded = sum(float(b.decode_tokens.sum()) for b in batches[: p.run.num_steps])
        assert trace.decoded_tokens == pytest.approx(decoded, rel=1e-9)


def test_async_schedules_overlap_rollout_with_training():
    p = varied(0)
    traces = simulate(p)
    s = {n: metrics.summary(t) for n, t in traces.items()}
    assert s["async"]["step_s"] < s["sync"]["step_s"]
    assert s["fully_async"]["rollout_busy_share"] >= s["sync"]["rollout_busy_share"]


def test_seeded_runs_are_deterministic_and_seeds_matter():
    a = metrics.summary(simulate(varied(3))["thunder"])
    b = metrics.summary(simulate(varied(3))["thunder"])
    c = metrics.summary(simulate(varied(4))["thunder"])
    assert a == b and a != c


def test_context_limit_truncates_turns():
    p = varied(0, workload={"max_context_tokens": 1500, "turns": const(50)})
    batch = sample_batch(p.workload, np.random.default_rng(0))
    per_turn = batch.decode_tokens + batch.observation_tokens
    starts = batch.turn_start[:-1]
    ctx = batch.prompt_tokens + np.add.reduceat(per_turn, starts)
    assert np.all((ctx <= 1500) | (batch.num_turns == 1))
    assert batch.num_turns.max() < 50
    assert np.all(batch.observation_tokens[batch.turn_start[1:] - 1] == 0)


def test_pipeline_bubble_penalises_streaming_lone_trajectories():
    p = varied(0, learner={"pipeline_parallel": 4}, cluster={"num_learner_gpus": 4})
    q = p.with_overrides({"learner": {"pipeline_parallel": 1, "tensor_parallel": 4}})
    batches = sample_batches(p, 2)
    extra_pp = run_thunder(p, batches).steps[-1].end - run_sync(p, batches).steps[-1].end
    extra_tp = run_thunder(q, batches).steps[-1].end - run_sync(q, batches).steps[-1].end
    assert math.isfinite(extra_pp) and extra_pp > extra_tp


def test_ownership_keeps_data_parallel_ranks_balanced():
    owner = claim_owners(np.arange(10.0), np.ones(10, dtype=np.int64), 2)
    assert np.bincount(owner).tolist() == [5, 5]


@pytest.mark.parametrize("seed", range(4))
def test_every_queue_policy_keeps_thunder_within_its_bounds(seed):
    """``queue_policy=group_aware`` (the trainer's ``rollout.engine.scheduling``): a waiting turn's
    priority is its group's members still generating, then its start. Under every policy, with a
    KV cap that makes turns wait, thunder stays between sync and the arrival bound."""
    for policy in ("fifo", "oldest_first", "group_aware"):
        p = varied(seed, rollout={"max_num_seqs": 3, "queue_policy": policy})
        batches = sample_batches(p, p.run.num_steps)
        sync, thunder = run_sync(p, batches), run_thunder(p, batches)
        ratio = metrics.zero_staleness_ratio(sync, thunder)
        assert 1 - 1e-12 <= ratio <= metrics.overlap_bound(sync)["B_arrival"] + 1e-9, policy


# -- gradients before the reward, per-turn score gradients ---------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_turn_items_split_each_trajectory_as_its_strategy_does(seed):
    from megathunder.simulate.learner_model import BACKWARD_SHARE, trajectory_work_s, turn_items

    p = varied(seed)
    batch = sample_batch(p.workload, np.random.default_rng(seed))
    work = trajectory_work_s(p, batch)
    turn_end = np.arange(int(batch.turn_start[-1]), dtype=float)  # any times: the items keep them
    finish = 1000.0 + np.arange(batch.size)
    owner = np.concatenate([np.repeat(np.arange(batch.size), batch.num_turns), np.arange(batch.size)])
    for strategy in ("forward_early", "kv_adjoint"):
        ready, items = turn_items(batch, work, turn_end, finish, strategy)
        assert np.array_equal(ready, np.concatenate([turn_end, finish]))
        per_traj = np.bincount(owner, weights=items)
        if strategy == "forward_early":  # its forwards, then the one backward: the trajectory's work
            assert per_traj == pytest.approx(work, rel=1e-12)
            assert items[-batch.size:] == pytest.approx(BACKWARD_SHARE * work, rel=1e-12)
        else:  # plus the sweep: a backward through every segment but the last
            single = batch.num_turns == 1
            assert per_traj[single] == pytest.approx(work[single], rel=1e-12)
            assert np.all(per_traj[~single] > work[~single]) and np.all(per_traj < (1 + BACKWARD_SHARE) * work)


def test_the_rollout_records_every_turn_end_and_the_last_is_the_finish():
    p = varied(1)
    batch = sample_batch(p.workload, np.random.default_rng(1))
    cluster = RolloutCluster(p)
    cluster.add_batch(batch, 0.0)
    cluster.run()
    assert [len(ends) for ends in cluster.turn_end_time] == batch.num_turns.tolist()
    assert [ends[-1] for ends in cluster.turn_end_time] == cluster.finish_time
    assert all(a <= b for ends in cluster.turn_end_time for a, b in zip(ends, ends[1:], strict=False))


@pytest.mark.parametrize("seed", range(3))
def test_earlier_work_never_slows_thunder_on_one_rank(seed):
    """One rank, no pipeline: pending gradients (work ready at the finish, not the reward) and
    forward_early turns (the same work, part of it earlier still) give steps no longer than
    per-trajectory streaming at the reward, which is itself the arrival bound; kv_adjoint's sweep
    adds work, so it has no such guarantee."""
    base = varied(seed, schedules={"max_group_slots": None})
    batches = sample_batches(base, base.run.num_steps)

    def steps(**schedules):
        trace = run_thunder(base.with_overrides({"schedules": schedules}), batches)
        return np.diff([0.0] + [s.end for s in trace.steps])

    at_reward = steps()
    pending = steps(pending_gradients=True)
    early = steps(per_turn_scores="forward_early")
    assert np.all(pending <= at_reward + 1e-9) and np.all(early <= pending + 1e-9)
    assert early.sum() < at_reward.sum()
