"""Ledger memory: bf16 slots within their derived bound, host-placed slots with the same update as
device slots, and K chosen from a memory budget (docs/exactness.md, section 2.7)."""

from __future__ import annotations

import pytest
import torch

from megathunder.config import GRPOObjective, LedgerConfig
from megathunder.objectives import LossSpec, batch_divisor, group_stats, normaliser, num_loss_tokens
from megathunder.streaming import GradientLedger, TorchBackend
from megathunder.streaming import synthetic as syn
from megathunder.streaming.buffers import slots_within_budget
from megathunder.streaming.reference import reference_gradient
from megathunder.trajectory import batch_plan
from tests.helpers import make_case, rel_err, small_model, streamed_gradient

U_BF16 = 2.0**-8  # unit roundoff of bfloat16 (8-bit significand, round to nearest)


def gamma(m: int) -> float:
    return m * U_BF16 / (1 - m * U_BF16)


def bf16_bound(model, batch, rewards, objective, ledger: GradientLedger) -> torch.Tensor:
    """The elementwise bound of docs/exactness.md 2.7 on |streamed - reference|, from the slot
    history the ledger logged: for each group with a slot, the trajectories it processed (in
    order), b_g the first one's reward, m_S / m_R the roundings into S_g / R_g."""
    backend = TorchBackend(model, objective)
    h = {}
    for t in batch:  # h_i = grad loss_i(A = -1): the score gradient a slot receives
        h[t.traj_id] = next(backend.backward(t, [LossSpec(advantage=-1.0, reward_free=False)])).flat().abs().clone()
    reward_of = {t.traj_id: r for t, r in zip(batch, rewards, strict=True)}
    in_slot: dict[int, list[int]] = {}
    group_of = {t.traj_id: t.group_id for t in batch}
    for _, kind, ident in ledger.events:
        if kind.startswith("backward:") and "slot" in kind.split(":")[1].split("+"):
            in_slot.setdefault(group_of[ident], []).append(ident)
    std_free = ledger.buffers_per_slot == 1
    kept = list(batch)
    z = normaliser([num_loss_tokens(t, objective) for t in kept], objective)
    stats = {g: group_stats([reward_of[i] for i in members], objective) for g, members in batch_plan(batch)}
    d = 1.0
    if objective.advantage == "batch_std":
        d = batch_divisor([reward_of[t.traj_id] - stats[t.group_id].mean for t in kept], objective)
    bound = torch.zeros_like(next(iter(h.values())))
    for g, processed in in_slot.items():
        b = reward_of[processed[0]]
        c, delta = stats[g].coef, stats[g].mean - b
        m_r = sum(1 for i in processed if reward_of[i] != b)
        if not std_free and m_r:
            bound += abs(c) * gamma(m_r) * sum(abs(reward_of[i] - b) * h[i] for i in processed)
        bound += abs(c * delta) * gamma(len(processed)) * sum(h[i] for i in processed)
    return bound / (d * z)


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "batch_std"])
@pytest.mark.parametrize("seed", range(4))
def test_bf16_slots_stay_within_the_derived_bound(advantage, seed):
    """fp64 model and accumulators, bf16 slots: every element of the streamed gradient is within the
    bound of the fp64 reference (the fp64 reassociation error, ~1e-16, is the slack)."""
    model = small_model("float64")
    rng, batch, rewards = make_case(300 + seed, torch.float64, "continuous")
    objective = GRPOObjective(advantage=advantage, loss_agg="seq_mean_token_sum")
    reference = reference_gradient(model, batch, rewards, objective)
    events = syn.random_event_order(rng, len(batch))
    streamed, result, ledger = streamed_gradient(
        model, batch, rewards, objective, LedgerConfig(max_group_slots=None, slot_dtype="bfloat16"), events)
    bound = bf16_bound(model, batch, rewards, objective, ledger)
    err = (streamed - reference).abs()
    slack = 1e-12 * reference.abs().max()
    assert err.max() > 1e3 * slack  # the slots really were bf16
    assert bool((err <= bound + slack).all()), float(((err - bound) / reference.abs().max()).max())
    exact, _, _ = streamed_gradient(model, batch, rewards, objective, LedgerConfig(max_group_slots=None), events)
    assert rel_err(exact, reference) <= 1e-10  # the same events with slots in the gradient's dtype
    assert result.peak_host_bytes == 0 and result.peak_device_bytes > 0


def test_bf16_slots_take_half_the_bytes_of_fp32_slots():
    model = small_model("float32")
    rng, batch, rewards = make_case(11, torch.float32, "binary")
    events = syn.random_event_order(rng, len(batch))
    objective = GRPOObjective()
    peak = {}
    for dtype in ("gradient", "bfloat16"):
        _, result, ledger = streamed_gradient(model, batch, rewards, objective,
                                              LedgerConfig(max_group_slots=2, slot_dtype=dtype), events)
        buffer = ledger.backend.live.nbytes
        slots = result.peak_buffers - 1  # P is an fp32 accumulator either way
        peak[dtype] = result.peak_device_bytes
        assert result.peak_device_bytes == buffer + slots * (buffer if dtype == "gradient" else buffer // 2)
    assert peak["bfloat16"] < peak["gradient"]


@pytest.mark.parametrize("slot_dtype", ["gradient", "bfloat16"])
@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "batch_std"])
@pytest.mark.parametrize("threads", [1, 3])
def test_host_placed_slots_give_the_same_update_as_device_slots(slot_dtype, advantage, threads):
    """On a CPU learner host and device are one memory and the same kernels run: bitwise equal,
    although host adds run on the pool's threads (``ledger.host_threads``), overlapped with the
    next backward -- so bf16 host slots are within the derived bound of bf16 device slots (above)."""
    model = small_model("float32")
    objective = GRPOObjective(advantage=advantage, kl_coef=0.05, entropy_coef=0.01)
    for seed in range(3):
        rng, batch, rewards = make_case(500 + seed, torch.float32, "binary")
        events = syn.random_event_order(rng, len(batch))
        grads, results = {}, {}
        for placement in ("device", "host"):
            cfg = LedgerConfig(max_group_slots=2, slot_dtype=slot_dtype, slot_placement=placement, host_threads=threads)
            grads[placement], results[placement], _ = streamed_gradient(model, batch, rewards, objective, cfg, events)
        assert torch.equal(grads["host"], grads["device"])
        assert results["host"].peak_buffers == results["device"].peak_buffers
        assert results["device"].peak_host_bytes == 0
        if results["host"].peak_buffers > 1:  # a slot was used: its bytes and one staging buffer on the host
            assert results["host"].peak_host_bytes > 0


def test_k_is_chosen_from_the_slot_budget():
    model = small_model("float64")
    objective = GRPOObjective()
    rng, batch, rewards = make_case(21, torch.float64, "continuous")
    buffer = TorchBackend(model, objective).live.nbytes
    events = syn.random_event_order(rng, len(batch))
    reference = reference_gradient(model, batch, rewards, objective)
    for fits in (0, 1, 2):
        budget = (2 * fits + 1.5) * buffer / 2**30  # room for `fits` slots of S and R, not one more
        cfg = LedgerConfig(max_group_slots=None, slot_budget_gb=budget)
        streamed, result, _ = streamed_gradient(model, batch, rewards, objective, cfg, events)
        assert result.max_group_slots == fits
        assert result.peak_buffers <= 2 * fits + 1
        assert rel_err(streamed, reference) <= 1e-10
    # a given K is only ever lowered; std-free slots hold one buffer
    assert slots_within_budget(1, 10.0, buffer, 2) == 1
    assert slots_within_budget(None, 3 * buffer / 2**30, buffer, 1) == 3
    assert slots_within_budget(5, None, buffer, 2) == 5


def test_slot_budget_and_placement_are_validated_at_parse_time():
    from megathunder.config import ConfigError, load_config

    for override, field in (("ledger.slot_budget_gb=-1", "ledger.slot_budget_gb"),
                            ("ledger.slot_dtype=float16", "ledger.slot_dtype"),
                            ("ledger.slot_placement=disk", "ledger.slot_placement")):
        with pytest.raises(ConfigError) as err:
            load_config(None, [override])
        assert field in str(err.value)


def test_pool_counts_bytes_by_placement():
    model = small_model("float32")
    objective = GRPOObjective()
    ledger = GradientLedger(TorchBackend(model, objective), objective,
                            LedgerConfig(max_group_slots=1, slot_placement="host"))
    _, batch, rewards = make_case(3, torch.float32, "binary")
    ledger.begin_batch(batch_plan(batch))
    syn.feed_events(ledger, batch, rewards, syn.sample_order_events(len(batch)))
    result = ledger.close_batch()
    buffer = ledger.backend.live.nbytes
    assert result.peak_device_bytes == buffer  # P only: on a CPU learner no device staging is needed
    assert result.peak_host_bytes == (result.peak_buffers - 1) * buffer + buffer  # slots + host staging


# -- host writes that keep up: several threads, chunks, one staged copy for S and R -------------------

@pytest.mark.parametrize("dst_dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alpha,first", [(1.0, True), (1.0, False), (-0.37, False), (2.5, True)])
def test_chunked_threaded_host_adds_are_bitwise_the_single_op(dst_dtype, alpha, first):
    """A write split into 4096-aligned chunks over 4 threads (the mover's), into two slots from one
    staged source, equals ``slot = alpha * h`` / ``slot += alpha * h`` done as one op per slot, bit
    for bit: tensors of odd sizes (tails in the last chunk), a bf16 slot from an fp32 source."""
    from megathunder.streaming.buffers import CHUNK_ALIGN, GradBuffer, _chunks, _HostMover, _write

    gen = torch.Generator().manual_seed(0)
    src_dtype = torch.float64 if dst_dtype == torch.float64 else torch.float32
    sizes = [5 * CHUNK_ALIGN + 3, 1, 70001, 2 * CHUNK_ALIGN]
    h = GradBuffer([torch.randn(n, generator=gen, dtype=src_dtype) for n in sizes])
    slots = [GradBuffer([torch.randn(n, generator=gen).to(dst_dtype) for n in sizes]) for _ in range(2)]
    expect = [GradBuffer([t.clone() for t in s.tensors]) for s in slots]
    _write(expect[0], h, 1.0, first)
    _write(expect[1], h, alpha, first)
    mover = _HostMover(h, threads=4)
    mover._chunks = _chunks(h, 4, CHUNK_ALIGN)  # many chunks per tensor, as on a GPU with small chunks
    assert len(mover._chunks) > len(sizes) + 4
    mover.write([(slots[0], 1.0, first), (slots[1], alpha, first)], h)
    mover.wait()
    for got, want in zip(slots, expect, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got.tensors, want.tensors, strict=True))


def test_chunks_cover_every_element_once_on_aligned_boundaries():
    from megathunder.streaming.buffers import CHUNK_ALIGN, GradBuffer, _chunks

    template = GradBuffer([torch.empty(n) for n in (3 * CHUNK_ALIGN + 17, 5, 0)])
    for pieces, most in ((1, 2**62), (4, 2**62), (3, CHUNK_ALIGN), (8, 3 * CHUNK_ALIGN)):
        chunks = _chunks(template, pieces, most)
        for k, t in enumerate(template.tensors):
            mine = [(a, b) for kk, a, b in chunks if kk == k]
            covered = [i for a, b in mine for i in range(a, b)]
            assert covered == list(range(t.numel()))
            assert all(a % CHUNK_ALIGN == 0 for a, _ in mine)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("pending", [0, 2])
def test_threaded_host_slots_match_the_batch_reference_in_fp64(threads, pending):
    """Host slots added on several threads, with pending gradients folded host-side: the batch
    reference within 1e-10 in fp64, and bitwise the device slots' update."""
    model = small_model("float64")
    objective = GRPOObjective(kl_coef=0.05, entropy_coef=0.01)
    for seed in range(3):
        rng, batch, rewards = make_case(700 + seed, torch.float64, "continuous")
        events = syn.random_event_order(rng, len(batch))
        reference = reference_gradient(model, batch, rewards, objective)
        grads = {}
        for placement in ("device", "host"):
            cfg = LedgerConfig(max_group_slots=2, max_pending=pending, slot_placement=placement, host_threads=threads)
            grads[placement], _, _ = streamed_gradient(model, batch, rewards, objective, cfg, events)
        assert rel_err(grads["host"], reference) <= 1e-10
        assert torch.equal(grads["host"], grads["device"])


def test_a_slot_path_gradient_is_staged_once_for_s_and_r():
    """Host slots: each slot-path (or pending) backward stages its gradient once, however many of
    S and R it goes into -- the second buffer does not wait for the first's transfer."""
    from megathunder.streaming.buffers import _HostMover

    model = small_model("float32")
    objective = GRPOObjective()
    rng, batch, rewards = make_case(3, torch.float32, "continuous")
    calls = []
    original = _HostMover.write

    def counted(self, writes, h):
        calls.append(len(writes))
        return original(self, writes, h)

    _HostMover.write = counted  # type: ignore[method-assign]
    try:
        cfg = LedgerConfig(max_group_slots=None, slot_placement="host", host_threads=2)
        _, _, ledger = streamed_gradient(model, batch, rewards, objective, cfg, syn.random_event_order(rng, len(batch)))
    finally:
        _HostMover.write = original  # type: ignore[method-assign]
    slot_backwards = sum(1 for _, kind, _ in ledger.events if kind.startswith("backward:") and "slot" in kind)
    assert len(calls) == slot_backwards > 0
    assert max(calls) == 2  # S and R from one staged copy


def test_a_pending_fold_into_a_host_slot_runs_beside_the_learner():
    """Host slots: folding a pending h_i into its group's slot is queued on the mover's threads like
    a write (it returns before the add has run), and the pending buffer, released at once, is not
    handed out again until the add that reads it is done."""
    import threading

    from megathunder.streaming import buffers

    model = small_model("float32")
    pool = buffers.BufferPool(TorchBackend(model, GRPOObjective()), slot_placement="host", host_threads=1)
    pool.acquire()  # the accumulators' layout, as the ledger's P
    slot, pend = pool.acquire_slot(), pool.acquire_slot()
    pend.tensors[0].fill_(0.5)
    gate = threading.Event()
    original = buffers._add_chunk

    def gated(*args):
        assert gate.wait(timeout=30)
        return original(*args)

    buffers._add_chunk = gated
    try:
        pool.slot_add(slot, pend, alpha=2.0, first=True)  # returns with the add still waiting on the gate
        assert pool._mover is not None and pool._mover.busy
        pool.release([pend])  # does not wait for the mover either
        assert pool._mover.busy and pool.num_live == 2  # the accumulator and the slot
        gate.set()
        again = pool.acquire_slot()  # the released buffer, once the add that read it is done
    finally:
        buffers._add_chunk = original
        gate.set()
    assert again is pend and pool.num_allocated == 3
    assert torch.equal(slot.tensors[0], torch.ones_like(slot.tensors[0]))
    assert torch.count_nonzero(again.tensors[0]) == 0  # handed out zeroed
