"""The run's summary (``megathunder.trainer.summary``): held-out pass@1 before RL and at the last
evaluation with their standard errors, and the gain in standard errors -- what a user reads to
know whether the run learned."""

from __future__ import annotations

import json
import math

import pytest

from megathunder.trainer.summary import held_out, write_summary


def _row(step: int, **extra) -> dict:
    return {"step": step, "schedule": "thunder", "reward_mean": 0.5, "step_s": 1.0, "learner_idle_share": 0.1,
            "policy_lag_max": 0, "probe_gap": 1e-6, "backward_after_last_reward": 1, "wall_s": 10.0 * (step + 1),
            **extra}


def test_the_summary_reports_the_held_out_gain_against_its_standard_error(tmp_path):
    (tmp_path / "eval_before.json").write_text(json.dumps({"eval/pass@1": 0.05, "eval/pass@1_stderr": 0.03}))
    rows = [_row(0), _row(1, **{"eval/pass@1": 0.30, "eval/pass@1_stderr": 0.06}), _row(2),
            _row(3, **{"eval/pass@1": 0.55, "eval/pass@1_stderr": 0.04})]
    summary = write_summary(tmp_path, rows)
    assert summary["eval_pass@1_before_rl"] == 0.05 and summary["eval_pass@1_last"] == 0.55
    assert summary["eval_pass@1_last_stderr"] == 0.04 and summary["eval_pass@1_first"] == 0.30
    assert summary["eval_pass@1_gain"] == pytest.approx(0.5)
    assert summary["eval_pass@1_gain_in_stderrs"] == pytest.approx(0.5 / math.hypot(0.03, 0.04), abs=0.01)  # 10.0
    assert json.loads((tmp_path / "summary.json").read_text())["eval_pass@1_gain"] == pytest.approx(0.5)


def test_without_an_evaluation_before_rl_there_is_no_gain(tmp_path):
    figures = held_out(tmp_path, [_row(0, **{"eval/pass@1": 0.3, "eval/pass@1_stderr": 0.05})])
    assert "eval_pass@1_gain" not in figures and figures["eval_pass@1_last"] == 0.3
    assert held_out(tmp_path, [_row(0)]) == {}
