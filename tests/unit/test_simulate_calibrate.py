"""``megathunder simulate --calibrate``: on a synthetic run directory written in the trainer's own
trace format from a sync timeline with known component times, calibration recovers those times
and predicts the step time; a run directory with missing files is a clear error; replayed turns
and weight syncs compose as on vLLM."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from megathunder.cli import main
from megathunder.config.loader import ConfigError
from megathunder.simulate.calibrate import calibrate, fit
from megathunder.simulate.rollout_model import RolloutCluster
from megathunder.simulate.run_dir import load_run
from megathunder.simulate.workload import Batch
from megathunder.trainer.timeline import write_trace

RATE = 50.0  # tokens/s of each generating sequence, whatever the concurrency
TOOL_S, VERIFY_S = 0.5, 1.0
SECONDS_PER_TOKEN, STEP_S, SYNC_S, GATHER_S = 1e-3, 0.2, 0.3, 0.1  # the rest of a sync: loading into vLLM
PROMPT, OBS = 100, 15
GROUPS, SAMPLES, STEPS = 2, 2, 3


def write_sync_run(out: Path, setup_s: float = 0.0) -> list[float]:
    """A sync run: every episode starts with its step (its first turn ``setup_s`` later: its
    sandbox built), two turns with a tool call between, then the verifier; after the last reward
    the batch's gradient, the optimizer step and the weight sync. Returns the step times."""
    spans, episodes, syncs, rows = [], [], [], []

    def learner(kind: str, start: float, dur: float, step: int) -> float:
        spans.append(SimpleNamespace(kind=kind, start=start, end=start + dur, step=step))
        return start + dur

    learner("gather_weights", 0.0, GATHER_S, 0)
    t = SYNC_S
    syncs.append((0.0, t, 0))
    for step in range(STEPS):
        start, tokens = t, 0
        for j in range(GROUPS * SAMPLES):
            d1, d2 = 20 + 10 * j + 5 * step, 10 + 5 * j
            first = start + setup_s
            end1 = first + d1 / RATE
            end2 = end1 + TOOL_S + d2 / RATE
            n = PROMPT + d1 + OBS + d2
            tokens += n
            episodes.append({"step": step, "start": first, "finished": end2, "reward": end2 + VERIFY_S,
                             "turns": 2, "group": j // SAMPLES, "prompt_tokens": PROMPT, "tokens": n,
                             "setup_s": setup_s,
                             "turn_spans": [(first, end1, end1 + TOOL_S, d1), (end1 + TOOL_S, end2, None, d2)]})
        t = max(e["reward"] for e in episodes[-GROUPS * SAMPLES:])
        t = learner("close", t, SECONDS_PER_TOKEN * tokens, step)
        t = learner("step", t, STEP_S, step)
        learner("gather_weights", t, GATHER_S, step + 1)
        syncs.append((t, t + SYNC_S, step + 1))
        t += SYNC_S
        busy = sum(s.end - s.start for s in spans if s.start >= start)
        rows.append({"step": step, "schedule": "sync", "step_s": t - start, "learner_busy_s": busy,
                     "learner_idle_share": 1 - busy / (t - start)})
    out.mkdir(parents=True)
    write_trace(out / "trace.json", spans, episodes, syncs, 0.0)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"run": {"seed": 0}, "schedule": {"mode": "sync"}, "ledger": {"max_group_slots": None},
              "batch": {"num_prompts_per_batch": GROUPS, "samples_per_prompt": SAMPLES},
              "learner": {"parallel": {"data_parallel": None}, "model": {"num_layers": 2, "hidden_size": 64}}}
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    return [r["step_s"] for r in rows]


def test_calibration_recovers_component_times_and_predicts_the_step(tmp_path):
    step_s = write_sync_run(tmp_path / "run")
    run = load_run(tmp_path / "run")
    cal = fit(run)
    lrn, w = cal.profile.learner, cal.profile.workload
    assert lrn.seconds_per_token == pytest.approx(SECONDS_PER_TOKEN, rel=1e-3)
    assert lrn.optimizer_step_s == pytest.approx(STEP_S, abs=1e-5)
    assert lrn.weight_sync_s == pytest.approx(SYNC_S, abs=1e-5)
    assert lrn.weight_sync_learner_s == pytest.approx(GATHER_S, abs=1e-5)
    for c, agg in cal.profile.rollout.decode_tokens_per_s:
        assert agg == pytest.approx(RATE * c, rel=1e-3)
    for b in cal.batches:  # the run's own workload, replayed
        assert (b.num_turns == 2).all() and (b.total_tokens == PROMPT + OBS + b.num_loss_tokens).all()
        assert b.tool_latency_s[0::2] == pytest.approx(TOOL_S, abs=1e-5)
        assert b.verifier_latency_s == pytest.approx(VERIFY_S, abs=1e-5)
    assert w.tool_latency_s.median == pytest.approx(TOOL_S, abs=1e-5)  # fitted, for fresh batches
    result = calibrate(run)
    assert result["measured_step_s"] == pytest.approx(sum(step_s[1:]) / (STEPS - 1))
    assert result["predicted_step_s"] == pytest.approx(result["measured_step_s"], rel=1e-3)  # replayed
    assert result["model_step_s"] == pytest.approx(result["measured_step_s"], rel=1e-3)  # fitted rates
    assert result["predicted_learner_idle"] == pytest.approx(result["measured_learner_idle"], abs=1e-3)


def test_each_episode_s_sandbox_set_up_is_replayed(tmp_path):
    """Episodes whose sandbox takes 0.7 s to build before their first turn (the SWE-style set's
    repositories): the set-up is read from the trace and replayed, so the predicted step is the
    measured one; without it the prediction would be 0.7 s short."""
    step_s = write_sync_run(tmp_path / "run", setup_s=0.7)
    run = load_run(tmp_path / "run")
    assert all(e.setup_s == pytest.approx(0.7) for e in run.episodes)
    result = calibrate(run)
    assert result["measured_step_s"] == pytest.approx(sum(step_s[1:]) / (STEPS - 1))
    assert result["predicted_step_s"] == pytest.approx(result["measured_step_s"], rel=1e-3)
    assert result["model_step_s"] == pytest.approx(result["measured_step_s"], rel=1e-3)


def test_cli_prints_the_table_and_one_json_line(tmp_path, capsys):
    write_sync_run(tmp_path / "run")
    assert main(["simulate", "--calibrate", str(tmp_path / "run"), "--out", str(tmp_path / "fit")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    last = json.loads(lines[-1])
    assert last["within_tolerance"] and last["calibration"][0]["schedule"] == "sync"
    assert len(list((tmp_path / "fit").glob("calibrated-*-run.yaml"))) == 1


def test_a_run_directory_missing_files_is_a_clear_error(tmp_path, capsys):
    write_sync_run(tmp_path / "run")
    (tmp_path / "run" / "trace.json").unlink()
    (tmp_path / "run" / "metrics.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"lacks metrics\.jsonl, trace\.json"):
        load_run(tmp_path / "run")
    assert main(["simulate", "--calibrate", str(tmp_path / "run")]) == 2
    assert "lacks metrics.jsonl, trace.json" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="not a run directory"):
        load_run(tmp_path / "nowhere")


def test_a_trace_without_turns_is_a_clear_error(tmp_path):
    write_sync_run(tmp_path / "run")
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("pid") != 2]
    (tmp_path / "run" / "trace.json").write_text(json.dumps(trace))
    with pytest.raises(ConfigError, match="no per-turn spans"):
        load_run(tmp_path / "run")


def test_a_trace_that_does_not_cover_every_step_is_a_clear_error(tmp_path):
    """A long run's trace keeps its last ``run.timeline_steps`` steps: not a whole run to replay."""
    write_sync_run(tmp_path / "run")
    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": STEPS, "schedule": "sync", "step_s": 1.0, "learner_busy_s": 0.5}) + "\n")
    with pytest.raises(ConfigError, match=f"covers steps 0-{STEPS - 1} of {STEPS + 1}"):
        load_run(tmp_path / "run")


def test_a_replayed_turn_runs_through_a_weight_sync_and_the_next_waits_for_its_end(tmp_path):
    """vLLM's pause(mode="wait"): running requests finish, new ones wait until the load is done."""
    write_sync_run(tmp_path / "run")
    profile = fit(load_run(tmp_path / "run")).profile
    batch = Batch(group=np.array([0]), prompt_tokens=np.array([0]), turn_start=np.array([0, 2]),
                  decode_tokens=np.array([5, 5]), observation_tokens=np.array([0, 0]),
                  tool_latency_s=np.array([0.5, 0.0]), verifier_latency_s=np.array([0.25]),
                  decode_s=np.array([1.0, 1.0]))
    cluster = RolloutCluster(profile)
    cluster.add_batch(batch, 0.0)
    cluster.pause(0.5, 2.0)  # [0.5, 2.5]: turn 1 (0 -> 1) runs on; turn 2, ready at 1.5, waits
    cluster.run()
    assert cluster.finish_time[0] == pytest.approx(3.5) and cluster.reward_time[0] == pytest.approx(3.75)


@pytest.mark.parametrize("ledger,pending,per_turn", [
    ({}, False, "off"),  # a run from before these keys
    ({"max_pending": 0, "per_turn_scores": "off"}, False, "off"),
    ({"max_pending": None, "per_turn_scores": "off"}, True, "off"),
    ({"max_pending": 4, "per_turn_scores": "forward_early"}, True, "forward_early"),
    ({"max_pending": None, "per_turn_scores": "kv_adjoint"}, True, "kv_adjoint"),
    ({"max_pending": None, "per_turn_scores": "recompute"}, True, "off"),  # its backward runs at the finish
])
def test_the_runs_gradients_before_the_reward_are_simulated_as_it_ran_them(tmp_path, ledger, pending, per_turn):
    write_sync_run(tmp_path / "run")
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    config["ledger"].update(ledger)
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(config))
    sched = fit(load_run(tmp_path / "run")).profile.schedules
    assert sched.pending_gradients is pending and sched.per_turn_scores == per_turn


def test_a_held_learner_starts_no_work_while_an_engine_decodes():
    """``schedules.hold_while_generating``: work ready while an engine decodes waits for the span's
    end; calibration sets it exactly where the trainer holds (an in-process engine on the learner's
    own cores, ``ledger.hold_while_generating: in_process``)."""
    from megathunder.simulate.calibrate import _ledger_mechanisms
    from megathunder.simulate.schedule_model import held_until_idle

    decoding = [(0.0, 1.0), (2.0, 3.0)]
    assert [held_until_idle(t, decoding) for t in (-1.0, 0.0, 0.5, 1.0, 1.5, 2.0, 2.9, 3.0)] == \
        [-1.0, 1.0, 1.0, 1.0, 1.5, 3.0, 3.0, 3.0]
    cfg = {"ledger": {"max_pending": 0}, "rollout": {"engine": {"deployment": "in_process"}}, "learner": {}}
    assert _ledger_mechanisms(cfg)["hold_while_generating"]
    never = {**cfg, "ledger": {"hold_while_generating": "never"}}
    own = {**cfg, "learner": {"cpu_cores": [0]}, "rollout": {"engine": {"deployment": "in_process", "cpu_cores": [1]}}}
    server = {**cfg, "rollout": {"engine": {"deployment": "server"}}}
    assert not any(_ledger_mechanisms(c)["hold_while_generating"] for c in (never, own, server))


def test_the_last_line_is_json_whatever_scalars_the_replay_gives():
    """The replay's figures come back as numpy scalars; the machine-readable line is still JSON."""
    from megathunder.simulate.sim_report import calibration_last_line

    row = {"run": "r", "schedule": "thunder", "measured_step_s": np.float64(10.0), "predicted_step_s": np.float64(11.0),
           "error": np.float64(0.1), "measured_learner_idle": 0.5, "predicted_learner_idle": np.float64(0.4),
           "model_step_s": 10.5, "model_error": 0.05}
    out = json.loads(calibration_last_line([row]))
    assert out["max_abs_error"] == 0.1 and out["within_tolerance"] is True
