"""Per-turn score gradients (``ledger.per_turn_scores``): each model turn's part of h_i computed
when the turn ends, accumulated in the trajectory's pending buffer, folded in at its reward.

The update is the batch-synchronous one (fp64, 1e-10 relative) for every advantage, aggregation it
allows, K, pending limit and per-turn strategy, under random interleavings of turns, finishes and
rewards across trajectories, with failed trajectories (a groupmate's turn buffer dropped mid-way),
DAPO, KL/entropy, token TIS (the engine logprobs come with each turn; a turn whose logprobs are not
the trajectory's sends it down the finish-time path), overlong filtering (turns that no longer make
up the loss mask: likewise) and ready-work packing. A trajectory streamed by turns never runs a score backward
of its own.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from megathunder.config import LedgerConfig
from megathunder.streaming import GradientLedger, TorchBackend
from megathunder.streaming.grpo_turns import ScoreTurns, check_streamable
from megathunder.streaming.opd_turns import TorchSegmentModel
from megathunder.trajectory import batch_plan, turn_spans
from tests.helpers import make_case, rel_err, small_model
from tests.unit.test_pending_gradients import CountingBackend, kept_reference
from tests.unit.test_streaming_exact import ADVANTAGES, SLOTS, random_objective, summing_backend

AGGREGATIONS = ["token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]  # nu_i = 1
STRATEGIES = ["kv_adjoint", "recompute", "forward_early"]
GRID = list(itertools.product(ADVANTAGES, AGGREGATIONS, SLOTS, STRATEGIES))  # 144 cases
REWARD_KINDS = ["binary", "continuous", "large_offset", "equal"]


def episode_events(rng: random.Random, batch, skip_turn_prob: float) -> list[tuple[str, int, int]]:
    """A random causal interleaving of every trajectory's ("turn", id, k) events (its loss mask's
    runs, in order), ("finished", id, -1) and ("reward", id, -1). With ``skip_turn_prob`` a turn's
    event is lost, so the turns streamed no longer make up the loss mask."""
    queues = []
    for t in batch:
        turns = [("turn", t.traj_id, k) for k in range(len(turn_spans(t))) if rng.random() >= skip_turn_prob]
        queues.append(turns + [("finished", t.traj_id, -1), ("reward", t.traj_id, -1)])
    order = []
    while any(queues):
        q = rng.choice([q for q in queues if q])
        order.append(q.pop(0))
    return order


def run_turns(model, batch, rewards, objective, ledger_cfg, events, strategy, *, packed, failed=None, queued=None,
              corrupt=frozenset(), max_streams=None):
    inner = summing_backend(model, objective) if packed else TorchBackend(model, objective)
    backend = CountingBackend(inner)
    ledger = GradientLedger(backend, objective, ledger_cfg)
    ledger.begin_batch(batch_plan(batch))
    turns = ScoreTurns(ledger, TorchSegmentModel(model), inner.live, strategy=strategy, max_streams=max_streams)
    by_id = {t.traj_id: t for t in batch}
    streamed_turns: set[int] = set()
    for k, (kind, tid, index) in enumerate(events):
        traj = by_id[tid]
        more = queued is not None and queued[k]
        if more:
            ledger.hold()
        if kind == "turn":
            start, end = turn_spans(traj)[index]
            engine = traj.rollout_logprobs[start - 1 : end - 1].tolist()
            if tid in corrupt and index == 0:
                engine[0] += 0.5  # the turn event's logprobs are not the trajectory's
            turns.on_turn(tid, traj.tokens[:end].tolist(), start, end, engine)
            if ledger.turn_buffer(tid) is not None:
                streamed_turns.add(tid)
        elif kind == "finished":
            turns.on_finished(traj)
            ledger.on_finished(traj)
        else:
            backend.rewarded.add(tid)
            ledger.on_reward(tid, None if tid == failed else rewards[tid])
        if not more:
            ledger.release()
    result = ledger.close_batch()
    return inner.live.flat().clone(), result, backend, turns


@pytest.fixture(scope="module")
def model64():
    return small_model("float64")


@pytest.mark.parametrize("case", range(len(GRID)))
def test_per_turn_score_gradients_give_the_batch_update_fp64(model64, case):
    advantage, loss_agg, slots, strategy = GRID[case]
    rng, batch, rewards = make_case(31000 + case, torch.float64, REWARD_KINDS[case % 4])
    objective = random_objective(rng, advantage, loss_agg)
    if objective.tis == "sequence":
        objective = objective.model_copy(update={"tis": "none"})
    hold = rng.random() < 0.4
    ledger_cfg = LedgerConfig(
        max_group_slots=slots, max_pending=rng.choice([1, 2, 3, None, None]), hold_groups_until_close=hold,
        reward_free_terms=rng.choice(["with_score", "at_finish"]),
        slot_placement=rng.choice(["device", "device", "host"]),
    )
    failed = rng.randrange(len(batch)) if hold and rng.random() < 0.6 else None
    events = episode_events(rng, batch, skip_turn_prob=rng.choice([0.0, 0.0, 0.2]))
    packed = rng.random() < 0.5
    queued = [rng.random() < 0.6 for _ in events] if packed else None
    corrupt = {t.traj_id for t in batch if rng.random() < 0.1}
    max_streams = rng.choice([None, None, 1, 2])
    streamed, result, _, turns = run_turns(model64, batch, rewards, objective, ledger_cfg, events, strategy,
                                           packed=packed, failed=failed, queued=queued, corrupt=corrupt,
                                           max_streams=max_streams)
    reference = kept_reference(model64, batch, rewards, objective, failed)
    if reference is None:
        assert result.num_kept_groups == 0 and streamed.abs().max() == 0
        return
    assert rel_err(streamed, reference) <= 1e-10, (objective, ledger_cfg, strategy, failed, packed)
    if ledger_cfg.max_pending is not None:
        assert result.peak_pending <= ledger_cfg.max_pending
    if max_streams is not None and strategy != "recompute":
        assert turns.streamer.stats["peak_cached"] <= max_streams


@pytest.mark.parametrize("case", range(24))
def test_a_trajectory_streamed_by_turns_runs_no_score_backward_of_its_own(model64, case):
    """Unbounded pending buffers, every turn delivered, no overlong filter: every trajectory with a
    trained token is streamed by turns, and the backend runs a score pass only for the others
    (those without turns: no loss tokens)."""
    advantage, loss_agg, slots, strategy = GRID[case * 6]
    rng, batch, rewards = make_case(33000 + case, torch.float64, REWARD_KINDS[case % 4])
    objective = random_objective(rng, advantage, loss_agg).model_copy(update={"tis": "none", "overlong_filter": False})
    ledger_cfg = LedgerConfig(max_group_slots=slots, max_pending=None)
    events = episode_events(rng, batch, skip_turn_prob=0.0)
    streamed, result, backend, turns = run_turns(model64, batch, rewards, objective, ledger_cfg, events, strategy,
                                                 packed=False)
    assert rel_err(streamed, kept_reference(model64, batch, rewards, objective, None)) <= 1e-10
    with_turns = {t.traj_id for t in batch if turn_spans(t)}
    assert result.num_turn_scores == len(with_turns)
    assert not with_turns & set(backend.score_passes()), "a trajectory streamed by turns ran its score again"
    assert turns.streamer.num_cached == 0  # every trajectory's K/V and graphs are gone


def test_a_dropped_group_stops_its_unfinished_trajectories_turns(model64):
    """A failed trajectory drops its group; a groupmate still generating loses its turn buffer and
    its later turns do nothing (its state is freed, nothing of it reaches the update)."""
    rng, batch, rewards = make_case(35000, torch.float64, "binary")
    objective = random_objective(rng, "grpo", "token_mean").model_copy(update={"tis": "none", "dapo_dynamic_sampling": False})
    ledger_cfg = LedgerConfig(max_pending=None, hold_groups_until_close=True)
    plan = batch_plan(batch)
    group = next(members for _, members in plan if len(members) >= 2
                 and all(len(turn_spans(batch[m])) >= 1 for m in members))
    failing, other = group[0], group[1]
    spans = turn_spans(batch[other])
    events = [("turn", other, 0), ("finished", failing, -1), ("reward", failing, -1)]
    events += [("turn", other, k) for k in range(1, len(spans))] + [("finished", other, -1), ("reward", other, -1)]
    for tid in sorted(set(range(len(batch))) - {failing, other}):
        events += [("finished", tid, -1), ("reward", tid, -1)]
    streamed, result, _, turns = run_turns(model64, batch, rewards, objective, ledger_cfg, events, "kv_adjoint",
                                           packed=False, failed=failing)
    reference = kept_reference(model64, batch, rewards, objective, failing)
    assert reference is not None and rel_err(streamed, reference) <= 1e-10
    assert result.num_turn_scores == 0 and turns.streamer.num_cached == 0


def test_objectives_a_turn_cannot_stream_are_refused():
    rng = random.Random(0)
    base = random_objective(rng, "grpo", "token_mean").model_copy(update={"tis": "none"})
    check_streamable(base)
    check_streamable(base.model_copy(update={"tis": "token"}))
    for update in ({"tis": "sequence"}, {"loss_agg": "seq_mean_token_mean"}):
        with pytest.raises(ValueError, match="per-turn"):
            check_streamable(base.model_copy(update=update))


def test_per_turn_scores_config_is_checked_by_name():
    from megathunder.config import ConfigError, load_config

    thunder = ["schedule.mode=thunder", "ledger.per_turn_scores=kv_adjoint"]
    past_kv = "learner.precision.core_attention=past_kv"
    with pytest.raises(ConfigError, match="ledger.per_turn_scores: kv_adjoint accumulates .* ledger.max_pending is 0"):
        load_config(None, thunder)
    with pytest.raises(ConfigError, match="ledger.per_turn_scores: kv_adjoint needs learner.precision.core_attention"):
        load_config(None, [*thunder, "ledger.max_pending=4"])
    with pytest.raises(ConfigError, match="objective.tis sequence"):
        load_config(None, [*thunder, "ledger.max_pending=4", past_kv, "objective.tis=sequence"])
    with pytest.raises(ConfigError, match="seq_mean_token_mean"):
        load_config(None, [*thunder, "ledger.max_pending=4", past_kv, "objective.loss_agg=seq_mean_token_mean"])
    with pytest.raises(ConfigError, match="learner.parallel.pipeline_parallel: ledger.per_turn_scores"):
        load_config(None, [*thunder, "ledger.max_pending=4", past_kv, "learner.parallel.pipeline_parallel=2",
                           "learner.model.num_layers=2"])
    with pytest.raises(ConfigError, match="objective.kind=opd"):
        load_config(None, [*thunder, "ledger.max_pending=4", past_kv, "objective.kind=opd"])
    load_config(None, [*thunder, "ledger.max_pending=4", past_kv])
    load_config(None, ["schedule.mode=thunder", "ledger.per_turn_scores=recompute", "ledger.max_pending=null"])
    load_config(None, ["schedule.mode=sync", "ledger.per_turn_scores=kv_adjoint"])  # only thunder streams


def test_the_plan_counts_the_retained_turn_graphs():
    from megathunder.config import load_config
    from megathunder.plan.memory_plan import Machine, ModelShape, plan

    base = ["schedule.mode=thunder", "ledger.max_pending=8", "learner.precision.core_attention=past_kv",
            "agent.max_concurrent_episodes=16"]
    shape = ModelShape.of(load_config(None, base).learner.model)
    lines = {}
    for extra in ([], ["ledger.per_turn_scores=kv_adjoint"], ["ledger.per_turn_scores=kv_adjoint", "ledger.max_turn_streams=2"],
                  ["ledger.per_turn_scores=recompute"]):
        out = plan(load_config(None, base + extra), shape, Machine(gpu_memory_gb=None, world=1))
        lines[" ".join(extra)] = {line.part: line for line in out.lines}
    assert "turn streams" not in lines[""] and "turn streams" not in lines["ledger.per_turn_scores=recompute"]
    eight = lines["ledger.per_turn_scores=kv_adjoint"]["turn streams"]
    two = lines["ledger.per_turn_scores=kv_adjoint ledger.max_turn_streams=2"]["turn streams"]
    assert eight.note.startswith("8 x") and two.note.startswith("2 x") and eight.device == 4 * two.device > 0
