"""``megathunder bench schedules``: each workload's added tool and verifier seconds, ablations against
the same sync, rounds (alternating order, medians of per-round ratios), and the paired run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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

    def fake_train(config, out, overrides, knobs):
        calls.append((out.name, overrides))
        thunder = "schedule.mode=thunder" in overrides
        step = 3.0 if not thunder else (2.5 if "ledger.per_turn_scores=off" in overrides else 2.0)
        _write_steps(out, [9.0, step, step], 0.5 if not thunder else 0.1)  # the cold first step is left out
        return {"max_policy_lag": 0, "reward_last_steps": 0.0}

    monkeypatch.setattr(schedule_runs, "_train", fake_train)
    args = _args(ablate=["per_turn", "packing"], overrides=["ledger.per_turn_scores=kv_adjoint"])
    res = schedule_runs.run_workload("tools", args, tmp_path)
    assert [name for name, _ in calls] == ["sync", "thunder", "thunder-no_per_turn", "thunder-no_packing"]
    no_turns = calls[2][1]
    assert "schedule.mode=thunder" in no_turns and no_turns[-1] == "ledger.per_turn_scores=off"  # after the run's own
    assert res["sync"]["bound"] == pytest.approx(2.0)  # busy 1.5 s of 3 s: (1.5 + 1.5) / 1.5
    assert res["thunder"]["vs_sync"] == pytest.approx(1.5) and res["thunder"]["of_bound"] == pytest.approx(0.75)
    assert res["thunder-no_per_turn"]["vs_sync"] == pytest.approx(1.2)


def _args(**kw) -> argparse.Namespace:
    base = dict(tool_latency=0.5, verifier_latency=1.0, slow_verifier_latency=3.0, steps=2, prompts=2, samples=2,
                sft_steps=0, overrides=[], schedules=["sync", "thunder"], ablate=[], config="c.yaml", rounds=1,
                paired=False)
    return argparse.Namespace(**{**base, **kw})


def _write_steps(out: Path, steps: list[float], idle: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"step": k, "step_s": s, "learner_idle_share": idle} for k, s in enumerate(steps)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_rounds_alternate_the_order_and_report_the_median_of_per_round_ratios(monkeypatch, tmp_path) -> None:
    """Round r's thunder is compared with round r's sync; the ratio reported is the median over rounds,
    not the ratio of median step times. Only the very first run warm-starts (SFT); every later run,
    in every round, starts from its model."""
    from megathunder.bench import schedule_runs

    steps = {("round0", "sync"): 3.0, ("round0", "thunder"): 2.0,   # 1.5
             ("round1", "thunder"): 1.0, ("round1", "sync"): 1.2,   # 1.2 (a faster machine this round)
             ("round2", "sync"): 2.0, ("round2", "thunder"): 2.5}   # 0.8
    calls = []

    def fake_train(config, out, overrides, knobs):
        calls.append((out.parent.name, out.name, [o for o in overrides if o.startswith(("sft.", "learner.model"))]))
        (out / "sft_model").mkdir(parents=True)
        _write_steps(out, [9.0, steps[out.parent.name, out.name]], 0.5)
        return {"max_policy_lag": 0, "reward_last_steps": 0.0}

    monkeypatch.setattr(schedule_runs, "_train", fake_train)
    res = schedule_runs.run_workload("quickstart", _args(rounds=3, sft_steps=5), tmp_path)
    assert [(r, label) for r, label, _ in calls] == [("round0", "sync"), ("round0", "thunder"), ("round1", "thunder"),
                                                    ("round1", "sync"), ("round2", "sync"), ("round2", "thunder")]
    assert calls[0][2] == ["sft.num_steps=5"]
    warm = [f"learner.model.hf_checkpoint={tmp_path / 'quickstart' / 'round0' / 'sync' / 'sft_model'}", "sft.num_steps=0"]
    assert all(c[2] == warm for c in calls[1:])
    assert res["thunder"]["rounds_vs_sync"] == pytest.approx([1.5, 1.2, 0.8])
    assert res["thunder"]["vs_sync"] == pytest.approx(1.2)  # the ratio of median steps (2.0 / 2.0) would say 1.0
    assert res["sync"]["step_s"] == 2.0 and res["sync"]["bound"] == pytest.approx(2.0)
    assert res["thunder"]["of_bound"] == pytest.approx(0.6)  # the median of 0.75, 0.6, 0.4


def test_the_paired_run_compares_each_sync_step_with_the_thunder_step_after_it(monkeypatch, tmp_path) -> None:
    """``--paired``: one more thunder run with ``bench_train --paired``; its ratio is the median over
    (sync step, next thunder step) pairs of sync's time over thunder's, the first pair left out --
    not the ratio of the two paths' median times -- and the rounds' medians of that."""
    from megathunder.bench import schedule_runs

    #          cold pair   pairs: 1.5,       1.0,        0.9
    steps = [9.0, 8.0, 3.0, 2.0, 2.0, 2.0, 1.8, 2.0]
    calls = []

    def fake_train(config, out, overrides, knobs):
        calls.append((out.name, overrides[-1], knobs[-1]))
        out.mkdir(parents=True)
        rows = [{"step": k, "step_s": s, "learner_idle_share": 0.5, "schedule": ("sync", "thunder")[k % 2]}
                for k, s in enumerate(steps)]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {"max_policy_lag": 0, "reward_last_steps": 0.0}

    monkeypatch.setattr(schedule_runs, "_train", fake_train)
    res = schedule_runs.run_workload("quickstart", _args(schedules=["sync"], paired=True), tmp_path)
    assert calls == [("sync", "schedule.mode=sync", "--verifier-latency=0.0"),
                     ("paired", "schedule.mode=thunder", "--paired")]
    p = res["paired"]
    assert p["pairs"] == 3 and p["paired_vs_sync"] == pytest.approx(1.0)  # the median of 1.5, 1.0, 0.9
    assert p["sync_step_s"] == 2.0 and p["thunder_step_s"] == 2.0 and p["step_s"] == 2.0
    res = schedule_runs.run_workload("quickstart", _args(schedules=["sync"], paired=True, rounds=2), tmp_path / "r")
    assert res["paired"]["rounds_paired"] == pytest.approx([1.0, 1.0])
    _write_steps(tmp_path / "plain", [1.0, 1.0], 0.5)  # a run of one path: no pair
    with pytest.raises(ValueError, match="no sync step followed by a thunder step"):
        schedule_runs.paired(tmp_path / "plain" / "metrics.jsonl")


def _trace(path: Path, steps: dict[int, dict[str, float]]) -> None:
    """A ``trace.json`` with, per step, its episodes, verifiers and gradient call at the given phase
    lengths (ms), steps back to back: the spans ``step_phases`` reads, in the timeline's format."""
    events = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
              for pid, name in ((0, "learner"), (1, "rollout"))]

    def span(pid: int, name: str, start: float, end: float, **args) -> None:
        events.append({"name": name, "ph": "X", "pid": pid, "tid": 0, "ts": round(start * 1e3),
                       "dur": round((end - start) * 1e3), "args": args})

    t = 0.0
    for step, p in steps.items():
        first = t + p["before_requests"]
        last = first + p["rollout"]
        span(1, "generate+tools", first, first + p["rollout"] / 2, step=step, episode=0)  # an early finisher
        span(1, "verify", first + p["rollout"] / 2, first + p["rollout"] / 2 + 0.1)
        span(1, "generate+tools", first + 0.2, last, step=step, episode=1)  # the last request starts later
        span(1, "verify", last, last + p["verifiers_after"])
        call = last + p["verifiers_after"] + p["to_gradient"]
        span(0, "close", call, call + p["gradient"], step=step)
        t = call + p["gradient"]
    path.write_text(json.dumps({"traceEvents": events}))


def test_phases_cut_each_step_between_two_gradient_calls(tmp_path) -> None:
    """``step_phases``: before the first request, rollout (first request to the last episode's end),
    the verifiers after it, the wait for the gradient call and the call; the first step has no
    previous call and is left out; the phases add up to the time between the two calls' ends.
    Beside them the arrival window: the first episode's end to the last's."""
    from megathunder.bench.schedule_runs import ANSWERS, PHASES, step_phases

    want = {0: dict(before_requests=5.0, rollout=30.0, verifiers_after=0.5, to_gradient=1.5, gradient=20.0),
            1: dict(before_requests=6.0, rollout=32.0, verifiers_after=0.3, to_gradient=0.5, gradient=21.0)}
    _trace(tmp_path / "trace.json", want)
    got = step_phases(tmp_path / "trace.json")
    assert list(got) == [1] and set(got[1]) == {*PHASES, ANSWERS}
    for name in PHASES:
        assert got[1][name] * 1e3 == pytest.approx(want[1][name], abs=2e-3)  # the trace's microseconds
    assert got[1][ANSWERS] * 1e3 == pytest.approx(32.0 / 2, abs=2e-3)  # the early finisher ends mid-rollout


def test_the_paired_run_reports_thunder_minus_sync_per_phase(monkeypatch, tmp_path, capsys) -> None:
    """``--paired`` with a trace: per phase the median over the compared pairs (the first left out)
    of thunder's time minus sync's, and sync's own time with its arrival window, in ms -- reported,
    and the rounds' medians of them."""
    from megathunder.bench import schedule_runs

    base = dict(before_requests=30.0, rollout=35.0, verifiers_after=0.2, to_gradient=1.2, gradient=27.0)
    thunder = dict(base, rollout=36.0, to_gradient=0.4)  # 1 ms more rollout, 0.8 less waiting
    steps = {k: (base if k % 2 == 0 else thunder) for k in range(8)}
    steps[1] = dict(base, rollout=99.0)  # the first pair, left out

    def fake_train(config, out, overrides, knobs):
        out.mkdir(parents=True)
        rows = [{"step": k, "step_s": 0.1, "learner_idle_share": 0.5, "schedule": ("sync", "thunder")[k % 2]}
                for k in steps]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        _trace(out / "trace.json", steps)
        return {"max_policy_lag": 0, "reward_last_steps": 0.0}

    monkeypatch.setattr(schedule_runs, "_train", fake_train)
    res = schedule_runs.run_workload("quickstart", _args(schedules=["sync"], paired=True, rounds=2), tmp_path)
    p = res["paired"]
    assert p["phase_rollout_ms"] == pytest.approx(1.0, abs=0.01)
    assert p["phase_to_gradient_ms"] == pytest.approx(-0.8, abs=0.01)
    for name in ("before_requests", "verifiers_after", "gradient"):
        assert p[f"phase_{name}_ms"] == pytest.approx(0.0, abs=0.01)
    for name, ms in dict(base, answers=35.0 / 2).items():  # sync's own, over the same pairs
        assert p[f"sync_{name}_ms"] == pytest.approx(ms, abs=0.01)
    monkeypatch.setattr(schedule_runs, "run_workload", lambda name, args, root: res)
    schedule_runs.main(["--workloads", "quickstart", "--paired"])
    out = capsys.readouterr().out
    assert ("quickstart: thunder minus sync per phase (ms, median over pairs): before the first request +0.0, "
            "rollout +1.0, verifiers after it +0.0, last reward to the gradient call -0.8, gradient call +0.0"
            in out)
    assert ("quickstart: sync's own phases (ms, median over the same pairs): before the first request 30.0, "
            "rollout 35.0, verifiers after it 0.2, last reward to the gradient call 1.2, gradient call 27.0; its "
            "episodes end within the rollout's last 17.5" in out)
