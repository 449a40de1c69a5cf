"""``megathunder bench learning``'s figures from run folders (synthetic curves, so each figure is
known): time to sync's scores as sync's time over the schedule's (geometric mean over the scores,
then a 95% interval over seeds), the score at a fixed budget and thunder's difference to each
schedule there, staleness, and a set that resumes (finished runs kept, none retrained)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from megathunder.bench import learning


def _run(root: Path, schedule: str, seed: int, scores: list[float], seconds_per_step: float, lag: int = 0,
         before: float = 0.1) -> Path:
    out = learning.run_dir(root, schedule, seed)
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(yaml.safe_dump({"schedule": {"mode": schedule}}))
    rows = []
    for k, score in enumerate(scores):
        wall = seconds_per_step * (k + 1)
        rows.append({"step": k, "wall_s": wall, "gpu_hours": wall / 3600, "schedule": schedule,
                     "policy_lag_mean": lag, "policy_lag_max": lag,
                     "eval/pass@1": score, "eval/pass@1_stderr": 0.05, "eval/pass@2": min(1.0, 1.5 * score)})
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "summary.json").write_text(json.dumps({"eval_pass@1_before_rl": before}))
    return out


def _set(root: Path) -> None:
    scores = [0.2, 0.4, 0.6]
    for seed, jitter in ((0, 0.0), (1, 0.02)):
        _run(root, "sync", seed, [s + jitter for s in scores], 10.0)
        _run(root, "thunder", seed, [s + jitter for s in scores], 5.0 + seed)  # 2x and 10/6 x as fast
        _run(root, "async", seed, [s - 0.1 + jitter for s in scores], 5.0, lag=1)


def test_time_to_score_budget_and_staleness_from_run_folders(tmp_path):
    _set(tmp_path)
    runs = [learning.load(learning.run_dir(tmp_path, s, k), s, k, "eval/pass@1")
            for s in ("sync", "thunder", "async") for k in (0, 1)]
    result = learning.report(runs)
    thunder, asy = result["schedules"]["thunder"], result["schedules"]["async"]
    mean, half = thunder["time_to_score_vs_sync"]
    assert mean == pytest.approx((2.0 + 10 / 6) / 2)  # per seed: sync's time over thunder's, every score
    assert half == pytest.approx(12.706 * math.sqrt(((2.0 - 10 / 6) ** 2) / 2) / math.sqrt(2))
    assert thunder["scores_reached"] == "6/6"
    assert asy["scores_reached"] == "4/6"  # async never reaches sync's best score
    assert result["budget_s"] == 15.0  # the shortest run's wall time: async's
    # each run's last evaluation within 15 s: thunder seed 0 at 15 s (0.6), seed 1 at 12 s (0.42)
    assert thunder["score_at_budget"][0] == pytest.approx((0.6 + 0.42) / 2)
    assert result["schedules"]["sync"]["score_at_budget"][0] == pytest.approx(0.21)  # one evaluation in 15 s
    assert result["schedules"]["sync"]["evaluated_at_budget"] == thunder["evaluated_at_budget"] == "2/2"
    late = learning.report(runs, budget_s=8.0)["schedules"]  # before sync's first evaluation (10 s)
    assert late["sync"]["evaluated_at_budget"] == "0/2" and "score_at_budget" not in late["sync"]
    assert late["thunder"]["evaluated_at_budget"] == "2/2"  # at 5 s and 6 s
    diff, half = asy["thunder_minus_this_at_budget"]  # paired by seed: 0.6 - 0.5, 0.42 - 0.52
    assert diff == pytest.approx(0.0, abs=1e-12) and half == pytest.approx(12.706 * 0.2 / math.sqrt(2) / math.sqrt(2))
    # pass@k at the same evaluations: thunder's seeds 1.5 * 0.6 = 0.9 and 1.5 * 0.42 = 0.63
    mean, se = thunder["pass_at_budget"]["pass@2"]
    assert mean == pytest.approx((0.9 + 0.63) / 2) and se == pytest.approx(abs(0.9 - 0.63) / 2)
    assert thunder["pass_at_budget"]["pass@1"][0] == thunder["score_at_budget"][0]
    assert asy["policy_lag_max"] == 1 and thunder["policy_lag_max"] == 0
    assert result["schedules"]["sync"]["steps_per_hour"][0] == pytest.approx(360.0)


def test_a_set_is_reported_from_its_folders_and_finished_runs_are_never_retrained(tmp_path, monkeypatch):
    _set(tmp_path)
    monkeypatch.setattr(learning.subprocess, "Popen", lambda *a, **k: pytest.fail("a finished run was retrained"))
    status = learning.main(["configs/quickstart.yaml", "--out", str(tmp_path), "--schedules", "sync", "thunder",
                            "async", "--seeds", "0", "1"])
    assert status == 0
    assert (tmp_path / "learning.png").stat().st_size > 10_000
    table = (tmp_path / "learning.md").read_text()
    assert "| thunder |" in table and "| async |" in table and "| schedule | pass@1 | pass@2 |" in table
    assert json.loads((tmp_path / "learning.json").read_text())["seeds"] == [0, 1]


def test_evaluations_are_off_the_clock(tmp_path):
    """A row's clock is read before its own evaluation: each evaluation's seconds come off every later
    row, so two runs of equal steps and unequal evaluation times have the same time to each score."""
    out = _run(tmp_path, "sync", 0, [0.2, 0.4, 0.6], 10.0)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    spent = 0.0
    for k, row in enumerate(rows):  # every row evaluates, for 25 s more each time
        row["wall_s"] += spent
        row["gpu_hours"] = row["wall_s"] / 3600
        row["eval/wall_s"] = 25.0 * (k + 1)
        spent += row["eval/wall_s"]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert learning.training_clock(rows) == [10.0, 20.0, 30.0]
    run = learning.load(out, "sync", 0, "eval/pass@1")
    assert run.curve.wall_s == [10.0, 20.0, 30.0]
    assert run.curve.gpu_hours == pytest.approx([10 / 3600, 20 / 3600, 30 / 3600])
    assert run.steps_per_hour == pytest.approx(360.0)


def test_stale_schedules_get_the_correction_they_need_and_nothing_else_changes():
    """async / fully_async are refused without an off-policy correction: where the config sets none
    they run with token TIS; sync and thunder run the config as it is; a config's own correction
    is kept."""
    import argparse

    args = argparse.Namespace(config="configs/quickstart.yaml", overrides=[])
    assert learning.correction(args, "async") == learning.correction(args, "fully_async") == ["objective.tis=token"]
    assert learning.correction(args, "sync") == learning.correction(args, "thunder") == []
    args.overrides = ["objective.tis=sequence"]
    assert learning.correction(args, "async") == []


def test_a_run_killed_outright_ends_with_its_code_and_takes_what_it_left_behind(tmp_path):
    """A run the OOM killer ends leaves its engine's processes behind, holding whatever output it
    was given: ``run_logged`` returns its exit code at once (a pipe's reader waited for them) and
    kills them."""
    import os
    import sys
    import time

    child = ("import subprocess, sys; p = subprocess.Popen(['sleep', '600']); print(p.pid, flush=True); "
             "sys.exit(3)")
    log = tmp_path / "train.log"
    start = time.monotonic()
    code = learning.run_logged([sys.executable, "-c", child], dict(os.environ), log, timeout_s=120)
    assert code == 3 and time.monotonic() - start < 60
    orphan = int(log.read_text().split()[0])
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{orphan}") and open(f"/proc/{orphan}/stat").read().split(")")[-1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the orphan outlived the run"
        time.sleep(0.05)
