"""``megathunder bench schedules``: each workload's added tool and verifier seconds."""

from __future__ import annotations

import argparse

import pytest

from megathunder.bench.schedule_runs import WORKLOADS, _latencies

pytestmark = pytest.mark.unit


def test_each_workload_adds_its_own_latency() -> None:
    args = argparse.Namespace(tool_latency=0.5, verifier_latency=1.0, slow_verifier_latency=3.0)
    assert _latencies("tools", args) == (0.5, 1.0)
    assert _latencies("verifier", args) == (0.0, 3.0)  # the verifier sets the pace, no tools
    assert _latencies("quickstart", args) == _latencies("swe_local", args) == (0.0, 0.0)
    assert WORKLOADS["verifier"] == WORKLOADS["quickstart"]  # the same task: only the verifier's time differs


def test_ablations_run_thunder_with_one_mechanism_off_against_the_same_sync(monkeypatch, tmp_path) -> None:
    from megathunder.bench import schedule_runs

    calls = []

    def fake_train(config, out, overrides):
        calls.append((out.name, overrides))
        thunder = "schedule.mode=thunder" in overrides
        step = 3.0 if not thunder else (2.5 if "ledger.per_turn_scores=off" in overrides else 2.0)
        return {"mean_step_s": step, "learner_idle_share": 0.5 if not thunder else 0.1, "max_policy_lag": 0,
                "reward_last_steps": 0.0}

    monkeypatch.setattr(schedule_runs, "_train", fake_train)
    args = argparse.Namespace(tool_latency=0.5, verifier_latency=1.0, slow_verifier_latency=3.0, steps=2,
                              prompts=2, samples=2, sft_steps=0, overrides=["ledger.per_turn_scores=kv_adjoint"],
                              schedules=["sync", "thunder"], ablate=["per_turn", "packing"], config="c.yaml")
    res = schedule_runs.run_workload("tools", args, tmp_path)
    assert [name for name, _ in calls] == ["sync", "thunder", "thunder-no_per_turn", "thunder-no_packing"]
    no_turns = calls[2][1]
    assert "schedule.mode=thunder" in no_turns and no_turns[-1] == "ledger.per_turn_scores=off"  # after the run's own
    assert res["sync"]["bound"] == pytest.approx(2.0)  # busy 1.5 s of 3 s: (1.5 + 1.5) / 1.5
    assert res["thunder"]["vs_sync"] == pytest.approx(1.5) and res["thunder"]["of_bound"] == pytest.approx(0.75)
    assert res["thunder-no_per_turn"]["vs_sync"] == pytest.approx(1.2)
