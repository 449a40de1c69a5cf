"""The streamed gradient equals the batch-synchronous reference (docs/exactness.md, section 2)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from megathunder.streaming import synthetic as syn

from megathunder.trajectory import batch_plan
from megathunder.config import GRPOObjective, LedgerConfig
from megathunder.streaming.reference import reference_gradient
from tests.helpers import make_case, rel_err, small_model, streamed_gradient

ADVANTAGES = ["grpo", "dr_grpo", "rloo", "batch_std"]
AGGREGATIONS = ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
SLOTS = [0, 1, 2, None]
REWARDS = ["binary", "continuous", "large_offset", "binary"]
# Every (advantage, aggregation, K) triple, each with every reward kind: 256 cases.
GRID = list(itertools.product(ADVANTAGES, AGGREGATIONS, SLOTS, REWARDS))


def random_objective(rng: random.Random, advantage: str, loss_agg: str) -> GRPOObjective:
    return GRPOObjective(
        advantage=advantage,
        loss_agg=loss_agg,
        loss_agg_norm_tokens=32,
        policy_loss=rng.choice(["ppo_clip", "gspo", "cispo"]),
        kl_coef=rng.choice([0.0, 0.05]),
        kl_estimator=rng.choice(["k1", "k2", "k3"]),
        entropy_coef=rng.choice([0.0, 0.01]),
        tis=rng.choice(["none", "token", "sequence"]),
        dapo_dynamic_sampling=rng.random() < 0.5,
        overlong_filter=rng.random() < 0.5,
        singleton_group=rng.choice(["zero", "raw_score"]),
        dapo_singletons=rng.choice(["drop", "keep"]),  # drawn last: the earlier draws stay what they were
    )


@pytest.fixture(scope="module")
def model64():
    return small_model("float64")


@pytest.fixture(scope="module")
def model32():
    return small_model("float32")


@pytest.mark.parametrize("case", range(len(GRID)))
def test_streamed_equals_reference_fp64(model64, case):
    advantage, loss_agg, slots, reward_kind = GRID[case]
    rng, batch, rewards = make_case(1000 + case, torch.float64, reward_kind)
    objective = random_objective(rng, advantage, loss_agg)
    ledger_cfg = LedgerConfig(
        max_group_slots=slots, reward_free_terms=rng.choice(["with_score", "at_finish"])
    )
    reference = reference_gradient(model64, batch, rewards, objective)
    events = syn.random_event_order(rng, len(batch))
    streamed, result, _ = streamed_gradient(model64, batch, rewards, objective, ledger_cfg, events)
    assert reference.abs().max() > 0 or result.num_kept_groups == 0
    assert rel_err(streamed, reference) <= 1e-10, (objective, ledger_cfg)


@pytest.mark.parametrize("case", range(64))
def test_streamed_equals_reference_fp32(model32, case):
    advantage, loss_agg, slots, reward_kind = GRID[case * 4 + case % 4]
    rng, batch, rewards = make_case(5000 + case, torch.float32, reward_kind)
    objective = random_objective(rng, advantage, loss_agg)
    reference = reference_gradient(model32, batch, rewards, objective)
    events = syn.random_event_order(rng, len(batch))
    streamed, _, _ = streamed_gradient(
        model32, batch, rewards, objective, LedgerConfig(max_group_slots=slots), events
    )
    assert rel_err(streamed, reference) <= 1e-4


def test_large_offset_fp32_needs_the_reward_shift(model32):
    """Rewards 1e4 + O(1e-2): without the shift, R - (mu - b) S cancels catastrophically in fp32."""
    objective = GRPOObjective(advantage="grpo")
    errors = {True: [], False: []}
    for seed in range(6):
        rng, batch, rewards = make_case(7000 + seed, torch.float32, "large_offset")
        reference = reference_gradient(model32, batch, rewards, objective)
        events = syn.random_event_order(rng, len(batch))
        for shift in (True, False):
            streamed, _, _ = streamed_gradient(
                model32, batch, rewards, objective, LedgerConfig(max_group_slots=None), events,
                reward_shift=shift,
            )
            errors[shift].append(rel_err(streamed, reference))
    assert max(errors[True]) <= 1e-4
    assert max(errors[False]) > 1e-2, errors[False]


ORACLE_OBJECTIVES = [
    GRPOObjective(advantage="grpo"),
    GRPOObjective(advantage="dr_grpo", loss_agg="seq_mean_token_sum_norm", loss_agg_norm_tokens=16),
    GRPOObjective(advantage="rloo", loss_agg="seq_mean_token_mean", kl_coef=0.1, tis="token"),
    GRPOObjective(
        advantage="grpo", loss_agg="seq_mean_token_sum", kl_coef=0.05, kl_estimator="k2",
        entropy_coef=0.01, dapo_dynamic_sampling=True, overlong_filter=True, tis="sequence",
    ),
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("objective", ORACLE_OBJECTIVES, ids=lambda o: o.advantage + "-" + o.loss_agg)
def test_oracle_order_is_bitwise_equal(dtype, objective):
    """K = 0, events in sample order, one trajectory per micro-batch in both paths: same bits."""
    model = small_model(dtype)
    torch_dtype = getattr(torch, dtype)
    for seed in range(4):
        _, batch, rewards = make_case(9000 + seed, torch_dtype, "binary")
        reference = reference_gradient(model, batch, rewards, objective, micro_batch_size=1)
        streamed, _, _ = streamed_gradient(
            model, batch, rewards, objective, LedgerConfig(max_group_slots=0),
            syn.sample_order_events(len(batch)),
        )
        assert torch.equal(streamed, reference), rel_err(streamed, reference)


def summing_backend(model, objective):
    """A TorchBackend that can also sum several trajectories in one call, as the Megatron one does."""
    from megathunder.objectives import token_logprobs_and_entropy, trajectory_loss
    from megathunder.streaming import TorchBackend

    backend = TorchBackend(model, objective)

    def backward_sum(trajs, specs):
        backend.live.zero_()
        for traj, spec in zip(trajs, specs, strict=True):
            logits = model(traj.tokens[None])[0, :-1]
            logp, ent = token_logprobs_and_entropy(logits, traj.tokens[1:], objective.entropy_coef > 0)
            trajectory_loss(logp, ent, traj, spec, objective).backward()
        return backend.live

    backend.backward_sum = backward_sum
    return backend


@pytest.mark.parametrize("case", range(0, len(GRID), 8))
def test_group_close_summed_backward_is_exact(model64, case, monkeypatch):
    """The ledger's one-call path for a closing group's trajectories (backward_sum)."""
    import megathunder.streaming.ledger as ledger_module

    advantage, loss_agg, slots, reward_kind = GRID[case]
    rng, batch, rewards = make_case(3000 + case, torch.float64, reward_kind)
    objective = random_objective(rng, advantage, loss_agg)
    reference = reference_gradient(model64, batch, rewards, objective)
    backend = summing_backend(model64, objective)
    calls = []
    original = backend.backward_sum
    backend.backward_sum = lambda trajs, specs: calls.append(len(trajs)) or original(trajs, specs)
    ledger = ledger_module.GradientLedger(backend, objective, LedgerConfig(max_group_slots=slots))
    ledger.begin_batch(batch_plan(batch))
    syn.feed_events(ledger, batch, rewards, syn.random_event_order(rng, len(batch)))
    ledger.close_batch()
    assert rel_err(backend.live.flat(), reference) <= 1e-10
    if slots == 0 and advantage != "batch_std" and not objective.dapo_dynamic_sampling:
        assert calls, "a K=0 batch with groups of several trajectories uses the summed path"


def events_with_added_groups(rng: random.Random, batch, events, first_added: int):
    """``events`` with an ("add", group) marker for every group >= ``first_added``, at a random point
    before its first event (as the trainer announces a replacement before its episodes start)."""
    group_of = {t.traj_id: t.group_id for t in batch}
    first_event = {}
    for i, ev in enumerate(events):
        first_event.setdefault(group_of[ev.traj_id], i)
    marks = sorted((rng.randint(0, first_event[g]), g) for g in first_event if g >= first_added)
    out, k = [], 0
    for i, ev in enumerate(events):
        while k < len(marks) and marks[k][0] == i:
            out.append(("add", marks[k][1]))
            k += 1
        out.append(ev)
    return out


@pytest.mark.parametrize("case", range(0, len(GRID), 4))
def test_groups_added_to_an_open_batch_give_the_batch_update(model64, case):
    """DAPO's refill (``add_group``): groups declared while the batch streams give the update of the
    batch declared with all of them at once (fp64, 1e-10), for every advantage, aggregation and K."""
    advantage, loss_agg, slots, reward_kind = GRID[case]
    rng, batch, rewards = make_case(13000 + case, torch.float64, reward_kind)
    objective = random_objective(rng, advantage, loss_agg).model_copy(update={"dapo_dynamic_sampling": True})
    plan = batch_plan(batch)
    first_added = rng.randint(1, len(plan) - 1)
    reference = reference_gradient(model64, batch, rewards, objective)
    from megathunder.streaming import GradientLedger, TorchBackend

    backend = TorchBackend(model64, objective)
    ledger = GradientLedger(backend, objective, LedgerConfig(max_group_slots=slots))
    ledger.begin_batch(plan[:first_added])
    by_id = {t.traj_id: t for t in batch}
    reward_of = {t.traj_id: r for t, r in zip(batch, rewards, strict=True)}
    for ev in events_with_added_groups(rng, batch, syn.random_event_order(rng, len(batch)), first_added):
        if isinstance(ev, tuple):
            ledger.add_group(ev[1], dict(plan)[ev[1]])
        elif ev.kind == "reward":
            ledger.on_reward(ev.traj_id, reward_of[ev.traj_id])
        else:
            ledger.on_finished(by_id[ev.traj_id])
    result = ledger.close_batch()
    assert result.num_kept_groups + result.num_dropped_groups == len(plan)
    assert rel_err(backend.live.flat(), reference) <= 1e-10, (objective, slots)


@pytest.mark.parametrize("case", range(0, len(GRID), 4))
def test_held_work_released_packed_is_exact(model64, case):
    """Ready-work packing (``GradientLedger.hold`` / ``release``): events queued behind others are
    bookkept first and their backward passes run when the queue empties (closed groups' members in
    one ``backward_sum``, across groups), at random queue states: the reference's gradient."""
    advantage, loss_agg, slots, reward_kind = GRID[case]
    rng, batch, rewards = make_case(11000 + case, torch.float64, reward_kind)
    objective = random_objective(rng, advantage, loss_agg)
    ledger_cfg = LedgerConfig(max_group_slots=slots, reward_free_terms=rng.choice(["with_score", "at_finish"]))
    reference = reference_gradient(model64, batch, rewards, objective)
    events = syn.random_event_order(rng, len(batch))
    queued = [rng.random() < 0.7 for _ in events]
    queued[-1] = rng.random() < 0.5  # close_batch releases whatever is still held
    backend = summing_backend(model64, objective)
    from megathunder.streaming.ledger import GradientLedger

    ledger = GradientLedger(backend, objective, ledger_cfg)
    ledger.begin_batch(batch_plan(batch))
    syn.feed_events(ledger, batch, rewards, events, queued=queued)
    ledger.close_batch()
    assert rel_err(backend.live.flat(), reference) <= 1e-10, (objective, ledger_cfg)


def test_a_queued_run_of_events_is_one_summed_backward(model64):
    """Every event queued behind another (all finishes, then all rewards, K unbounded): no slot
    write, no per-trajectory pass -- the whole batch in one ``backward_sum`` when the queue empties."""
    from megathunder.streaming.ledger import GradientLedger

    objective = GRPOObjective(advantage="grpo", kl_coef=0.05, entropy_coef=0.01)
    _, batch, rewards = make_case(12000, torch.float64, "continuous")
    reference = reference_gradient(model64, batch, rewards, objective)
    backend = summing_backend(model64, objective)
    calls = []
    original = backend.backward_sum
    backend.backward_sum = lambda trajs, specs: calls.append(len(trajs)) or original(trajs, specs)
    ledger = GradientLedger(backend, objective, LedgerConfig(max_group_slots=None))
    ledger.begin_batch(batch_plan(batch))
    events = [syn.Event("finished", t.traj_id) for t in batch] + [syn.Event("reward", t.traj_id) for t in batch]
    syn.feed_events(ledger, batch, rewards, events, queued=[True] * (len(events) - 1) + [False])
    ledger.close_batch()
    assert calls == [len(batch)] and backend.num_backward == 0
    assert rel_err(backend.live.flat(), reference) <= 1e-10


class _OneAtATime:
    """A TorchBackend without ``backward_each``: the ledger runs every own-gradient pass alone."""

    backward_each = None


@pytest.mark.parametrize("case", range(1, len(GRID), 4))
def test_packed_own_gradients_are_bitwise_one_at_a_time(model64, case):
    """``backward_each`` (the ledger's packed slot and pending passes): with work held and released
    at random queue states, bounded slots and pending buffers, the update is bit for bit the one
    the same events give with every own-gradient pass run alone, and some runs were packed."""
    from megathunder.streaming import GradientLedger, TorchBackend

    advantage, loss_agg, slots, reward_kind = GRID[case]
    rng, batch, rewards = make_case(15000 + case, torch.float64, reward_kind)
    objective = random_objective(rng, advantage, loss_agg)
    ledger_cfg = LedgerConfig(max_group_slots=slots, max_pending=rng.choice([0, 2, None]),
                              reward_free_terms=rng.choice(["with_score", "at_finish"]),
                              defer_uniform_groups=case % 8 == 5)  # deferring can leave a case nothing to pack
    events = syn.random_event_order(rng, len(batch))
    queued = [rng.random() < 0.7 for _ in events]
    queued[-1] = False
    runs: list[int] = []
    grads = []
    for kind in (TorchBackend, type("Alone", (_OneAtATime, TorchBackend), {})):
        backend = kind(model64, objective)  # each points the model's .grad at its own storage
        if backend.backward_each is not None:
            each = backend.backward_each
            backend.backward_each = lambda items, on_grad, each=each: runs.append(len(items)) or each(items, on_grad)
        ledger = GradientLedger(backend, objective, ledger_cfg)
        ledger.begin_batch(batch_plan(batch))
        syn.feed_events(ledger, batch, rewards, events, queued=queued)
        ledger.close_batch()
        grads.append(backend.live.flat().clone())
    assert torch.equal(grads[0], grads[1]), (objective, ledger_cfg, rel_err(grads[0], grads[1]))
    if slots != 0 and not ledger_cfg.defer_uniform_groups:
        assert runs and max(runs) >= 2, "no two own-gradient passes were ever packed"


def test_packed_own_gradients_were_taken_in_some_grid_case(model64):
    """The packed path is not vacuous across the grid above: a case with slots packs passes."""
    from megathunder.streaming import GradientLedger, TorchBackend

    objective = GRPOObjective(advantage="grpo", kl_coef=0.05)
    _, batch, rewards = make_case(15999, torch.float64, "continuous")
    reference = reference_gradient(model64, batch, rewards, objective)
    backend = TorchBackend(model64, objective)
    runs = []
    each = backend.backward_each
    backend.backward_each = lambda items, on_grad: runs.append(len(items)) or each(items, on_grad)
    ledger = GradientLedger(backend, objective, LedgerConfig(max_group_slots=None))
    ledger.begin_batch(batch_plan(batch))
    events = [syn.Event("finished", t.traj_id) for t in batch] + [syn.Event("reward", t.traj_id) for t in batch]
    syn.feed_events(ledger, batch, rewards, events, queued=[True] * (len(events) - 1) + [False])
    ledger.close_batch()
    assert runs and max(runs) >= 2
    assert rel_err(backend.live.flat(), reference) <= 1e-10
