"""The console entry points run for real (shortened by overrides) and end with one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megathunder.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


def test_exactness_run_streams_checks_and_learns(tmp_path):
    proc = _run("exactness", "configs/grpo_exactness.yaml", "run.num_steps=12",
                f"run.output_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["max_rel_err_vs_sync"] <= 1e-4
    assert summary["reward_last_steps"] > summary["reward_first_steps"]
    assert summary["mean_backward_after_last_reward_thunder"] < summary["mean_backward_after_last_reward_sync"]
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 12


def test_bench_ledger_reports_memory_at_the_bound():
    proc = _run("bench", "ledger", "--hidden-size", "32", "--num-layers", "1", "--vocab-size", "64",
                "--seq-len", "32", "--num-groups", "3", "--group-size", "3", "--repeats", "1",
                "--slots", "0", "1", "3")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["memory_within_bound"]
    assert [m["peak_buffers"] for m in result["memory"]] == [1, 3, 7, 1, 2, 4]


def test_help_lists_the_subcommands():
    proc = _run("--help")
    assert proc.returncode == 0
    for name in ("config", "exactness", "bench"):
        assert name in proc.stdout
