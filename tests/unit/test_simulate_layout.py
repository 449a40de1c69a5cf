"""The simulator held to the layout (``megathunder.simulate.layout``): a profile with a trainer config
takes its layout, batch, scheduling and ledger from it, with the ledger lowered to what its
``megathunder plan`` fits -- or refused when nothing of it does; a layout that does not fit at all
is an error. And a learner call's fixed cost, fitted from calls of different sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megathunder.plan.memory_plan import GiB, plan, stage_params
from megathunder.simulate.call_cost import fit_call_cost
from megathunder.simulate.layout import LayoutError, hold, machine_of, shape_of, trainer_config
from megathunder.simulate.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_128_gpu_config_sets_the_layout_batch_and_ledger():
    held = hold(load_profile("swe_smith_128"))
    p, cfg = held.profile, held.config
    assert held.notes == [] and held.thunder_refused is None  # as shipped it fits
    assert (p.learner.tensor_parallel, p.learner.pipeline_parallel, p.num_dp) == (8, 2, 6)
    assert (p.workload.num_prompts_per_batch, p.workload.samples_per_prompt) == (64, 16)
    assert p.workload.max_context_tokens == 32768 and p.learner.flops_per_param_token == 8.0
    assert p.ledger.placement == "host" and p.ledger.slot_dtype == "float32" and p.ledger.buffers_per_slot == 2
    assert p.schedules.max_group_slots == 4  # 64 GiB budget / (2 x 8 GiB pinned buffers)
    assert p.rollout.queue_policy == {"fifo": "fifo", "trajectory_start": "oldest_first",
                                      "group_aware": "group_aware"}[cfg.rollout.engine.scheduling]
    shape = shape_of(cfg)
    assert p.buffer_params == sum(stage_params(shape, 8, 2, held.plan.stage))
    assert p.model.num_params == shape.num_params


def test_device_slots_that_do_not_fit_are_lowered_to_the_largest_k_that_does():
    held = hold(load_profile("swe_smith_128", ["trainer.ledger.slot_placement=device"]))
    k = held.profile.schedules.max_group_slots
    assert k is not None and 0 < k < 4
    assert any("do not fit" in n for n in held.notes) and any(f"{k}, the most that fits" in n for n in held.notes)
    profile, shape, machine = held.profile, shape_of(held.config), machine_of(held.profile)
    base = ["ledger.slot_placement=device"]
    assert plan(trainer_config(profile, [*base, f"ledger.max_group_slots={k}"]), shape, machine).feasible
    assert not plan(trainer_config(profile, [*base, f"ledger.max_group_slots={k + 1}"]), shape, machine).feasible


def test_pending_buffers_are_lowered_before_k():
    held = hold(load_profile("swe_smith_128", ["trainer.ledger.slot_placement=device", "trainer.ledger.slot_dtype=bfloat16",
                                               "trainer.ledger.slot_budget_gb=null", "trainer.ledger.max_group_slots=2",
                                               "trainer.ledger.max_pending=null"]))
    s = held.profile.schedules
    assert s.max_group_slots == 2 and s.pending_gradients and s.max_pending is not None and s.max_pending >= 1
    assert any(n.startswith("pending buffers") for n in held.notes)


@pytest.mark.parametrize("max_pending", ["8", "null"])
def test_pending_buffers_a_budget_leaves_no_room_for_are_off(max_pending):
    """The shipped 64 GiB host budget holds K = 4 slots and nothing beside them: asked for pending
    buffers, the plan counts none, and so does the simulation (not one per trajectory)."""
    held = hold(load_profile("swe_smith_128", [f"trainer.ledger.max_pending={max_pending}"]))
    assert not any(line.part == "ledger pending" for line in held.plan.lines)
    s = held.profile.schedules
    assert s.max_group_slots == 4 and not s.pending_gradients and s.max_pending == 0
    roomy = hold(load_profile("swe_smith_128", [f"trainer.ledger.max_pending={max_pending}",
                                                "trainer.ledger.max_group_slots=4", "trainer.ledger.slot_budget_gb=128"]))
    assert roomy.profile.schedules.pending_gradients and roomy.profile.schedules.max_pending == int(
        max_pending if max_pending != "null" else 8)


def test_thunder_is_refused_when_not_even_p_fits():
    """GPUs just large enough for the layout without the ledger: P (one fp32 buffer) does not fit
    beside it, so no thunder figure -- and the CLI prints none, saying why."""
    profile = load_profile("swe_smith_128")
    cfg = trainer_config(profile, ["schedule.mode=sync"])
    sync_total = plan(cfg, shape_of(cfg), machine_of(profile)).device_total
    tight = (sync_total + 2 * GiB) / GiB  # < P + the staging buffer (7.6 GiB each)
    held = hold(profile.with_overrides({"cluster": {"gpu_memory_gb": tight}}))
    assert held.thunder_refused is not None and "P" in held.thunder_refused
    proc = subprocess.run([sys.executable, "-m", "megathunder.cli", "simulate", "swe_smith_128", f"cluster.gpu_memory_gb={tight}",
                           "trainer.batch.num_prompts_per_batch=8", "run.num_steps=2", "--schedules", "sync", "thunder",
                           "--no-plots", "--out", "/tmp/mt-sim-refused"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "thunder" not in last["schedules"] and last["thunder_refused"] and "thunder_vs_sync" not in last
    assert "THUNDER NOT REPORTED" in proc.stdout


def test_a_layout_that_does_not_fit_without_the_ledger_is_an_error():
    """A 32B policy on the 8-GPU profile's 4 learner GPUs: weights, gradients and Adam alone exceed
    them, so no schedule is simulated."""
    big = [f"trainer.learner.model.{k}={v}" for k, v in (("hidden_size", 5120), ("ffn_hidden_size", 27648),
                                                          ("num_layers", 64), ("num_attention_heads", 40),
                                                          ("num_query_groups", 8))]
    with pytest.raises(LayoutError, match="does not fit even without thunder's ledger.*optimizer"):
        hold(load_profile("swe_smith", big))


def test_the_engine_s_configured_scheduling_is_the_simulated_queue_policy():
    for scheduling, policy in (("fifo", "fifo"), ("trajectory_start", "oldest_first"), ("group_aware", "group_aware")):
        held = hold(load_profile("swe_smith", [f"trainer.rollout.engine.scheduling={scheduling}",
                                               "rollout.queue_policy=most_turns_first"]))
        assert held.profile.rollout.queue_policy == policy


def test_simulate_config_runs_a_shipped_config_on_the_workload():
    proc = subprocess.run([sys.executable, "-m", "megathunder.cli", "simulate", "--config", "launch/slurm/grpo_128gpu.yaml",
                           "trainer.batch.num_prompts_per_batch=8", "run.num_steps=2", "--schedules", "sync", "thunder",
                           "--no-plots", "--out", "/tmp/mt-sim-config"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["ledger"]["held_to_plan"] and last["ledger"]["placement"] == "host" and last["ledger"]["K"] == 4
    assert 0 < last["fraction_of_B"] <= 1.0 + 1e-9
    assert "held to `megathunder plan` of launch/slurm/grpo_128gpu.yaml" in proc.stdout


def test_call_cost_is_the_slope_over_calls_of_one_batch():
    assert fit_call_cost([(1, 1.0 + 0.01), (8, 1.0 + 0.08), (32, 1.0 + 0.32)])[:2] == pytest.approx((0.01, 1.0))
    # BENCHMARKS.md, `bench learner` on the quickstart's 32 x 44: 1 / 8 / 32 calls
    F, _, residual = fit_call_cost([(1, 0.0394), (8, 0.1151), (32, 0.3938)])
    assert F == pytest.approx(0.0114, abs=0.0005) and residual < 0.005
    with pytest.raises(ValueError, match="two different counts"):
        fit_call_cost([(1, 0.1), (1, 0.2)])
