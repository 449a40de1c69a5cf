"""The schedule comparison report on synthetic runs whose answer is known: a thunder run that
makes the same steps as sync at 0.6 of the GPU-hours reaches every sync score at ratio 1/0.6."""

from __future__ import annotations

import json

import pytest
import yaml

from megathunder import cli
from megathunder.eval.cost_report import ReportError, build_report, load_run

SYNC_SCORES = {2: 0.10, 4: 0.25, 6: 0.20, 8: 0.40, 10: 0.55}  # not monotone: 0.20 after 0.25


def _write_run(path, schedule, hours_per_step, scores, num_steps=10, num_procs=2, extra=None):
    path.mkdir(parents=True)
    cfg = {"schedule": {"mode": schedule}, "run": {"output_dir": str(path)}, "batch": {"samples_per_prompt": 4}}
    cfg.update(extra or {})
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = []
    for step in range(1, num_steps + 1):
        wall = step * hours_per_step * 3600 / num_procs
        row = {"step": step, "wall_s": wall, "gpu_hours": wall * num_procs / 3600,
               "schedule": schedule, "loss": 0.1}  # fmt: skip
        if step in scores:
            row["eval/pass@1"] = scores[step]
            row["eval/pass@1_stderr"] = 0.02
            row["eval/pass@2"] = min(1.0, scores[step] * 1.5)
        rows.append(json.dumps(row))
    (path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    return path


def test_report_curves_and_time_to_score(tmp_path):
    sync = _write_run(tmp_path / "sync", "sync", 0.1, SYNC_SCORES)
    # thunder: the same updates (same scores per step) at 0.6 of the cost, but stops at step 8
    thunder = _write_run(tmp_path / "thunder", "thunder", 0.06, SYNC_SCORES, num_steps=8)
    out = tmp_path / "report"
    report = build_report([str(thunder), str(sync)], out)
    assert report["baseline"] == "sync" and report["warnings"] == []
    rows = report["time_to_score"]
    assert [r["score"] for r in rows] == [0.10, 0.20, 0.25, 0.40, 0.55]
    by_score = {r["score"]: r for r in rows}
    # 0.20 is first reached at step 4 (0.25 >= 0.20), not at step 6 where sync scored it
    assert by_score[0.20]["baseline_step"] == 4 and by_score[0.20]["run_step"] == 4
    for s in (0.10, 0.20, 0.25, 0.40):
        assert by_score[s]["gpu_hours_ratio"] == pytest.approx(1 / 0.6)
        assert by_score[s]["wall_time_ratio"] == pytest.approx(1 / 0.6)
    assert by_score[0.55]["run_step"] is None and by_score[0.55]["gpu_hours_ratio"] is None
    assert by_score[0.40]["baseline_gpu_hours"] == pytest.approx(0.8)
    assert by_score[0.40]["run_gpu_hours"] == pytest.approx(0.48)

    png = (out / "score_vs_gpu_hours.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    csv_lines = (out / "time_to_score.csv").read_text().splitlines()
    assert csv_lines[0].startswith("score,run,schedule") and len(csv_lines) == 6
    md = (out / "time_to_score.md").read_text()
    assert "not reached" in md and "| 1.67 |" in md
    saved = json.loads((out / "report.json").read_text())
    assert [r["schedule"] for r in saved["runs"]] == ["thunder", "sync"]
    assert saved["runs"][1]["steps"] == [2, 4, 6, 8, 10]


def test_other_metric_and_explicit_baseline(tmp_path):
    a = _write_run(tmp_path / "a", "async", 0.05, {5: 0.3, 10: 0.6})
    b = _write_run(tmp_path / "b", "thunder", 0.04, {5: 0.3, 10: 0.6})
    report = build_report([str(a), str(b)], tmp_path / "r", metric="eval/pass@2", baseline=str(a))
    assert [r["score"] for r in report["time_to_score"]] == pytest.approx([0.45, 0.9])
    assert report["time_to_score"][0]["gpu_hours_ratio"] == pytest.approx(0.05 / 0.04)


def test_config_differences_are_warned(tmp_path):
    sync = _write_run(tmp_path / "sync", "sync", 0.1, SYNC_SCORES)
    other = _write_run(tmp_path / "t", "thunder", 0.06, SYNC_SCORES,
                       extra={"batch": {"samples_per_prompt": 8}})  # fmt: skip
    report = build_report([str(sync), str(other)], tmp_path / "r")
    assert len(report["warnings"]) == 1 and "batch.samples_per_prompt" in report["warnings"][0]


def _rewrite(path, fn):
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in fn(rows)) + "\n")


def test_bad_runs_are_clear_errors(tmp_path):
    sync = _write_run(tmp_path / "sync", "sync", 0.1, SYNC_SCORES)
    t = _write_run(tmp_path / "t", "thunder", 0.06, SYNC_SCORES)
    with pytest.raises(ReportError, match="at least two"):
        build_report([str(sync)], tmp_path / "r")
    with pytest.raises(ReportError, match="no such run folder"):
        load_run(tmp_path / "missing")
    with pytest.raises(ReportError, match="0 runs with schedule sync"):
        build_report([str(t), str(t)], tmp_path / "r")
    with pytest.raises(ReportError, match="no rows with 'eval/pass@3'"):
        build_report([str(sync), str(t)], tmp_path / "r", metric="eval/pass@3")

    _rewrite(t, lambda rows: [{k: v for k, v in r.items() if k != "gpu_hours"} for r in rows])
    with pytest.raises(ReportError, match=r"metrics.jsonl:1: missing key 'gpu_hours'"):
        load_run(t)
    _rewrite(t, lambda rows: [{**r, "gpu_hours": 1.0 - 0.01 * r["step"]} for r in rows])
    with pytest.raises(ReportError, match=r"metrics.jsonl:2: gpu_hours must be a cumulative"):
        load_run(t)
    _rewrite(t, lambda rows: [{**r, "gpu_hours": 0.1 * r["step"], "schedule": "sync"} for r in rows])
    with pytest.raises(ReportError, match="differs from config.yaml's 'thunder'"):
        load_run(t)
    (t / "metrics.jsonl").write_text('{"step": 1,\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl:1: invalid JSON"):
        load_run(t)
    (t / "config.yaml").unlink()
    with pytest.raises(ReportError, match="no config.yaml"):
        load_run(t)


def test_cli(tmp_path, capsys):
    sync = _write_run(tmp_path / "sync", "sync", 0.1, SYNC_SCORES)
    t = _write_run(tmp_path / "t", "thunder", 0.06, SYNC_SCORES)
    rc = cli.main(["eval-report", str(sync), str(t), "--out", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert rc == 0 and "| 0.550 |" in out and (tmp_path / "r" / "report.json").is_file()
    rc = cli.main(["eval-report", str(sync), str(tmp_path / "nope"), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == f"megathunder eval-report: {tmp_path / 'nope'}: no such run folder"
