"""``megathunder bench sandbox``: the local runtime against a sandbox server on loopback, every
operation counted, and nothing left behind (servers stopped, work dirs removed)."""

from __future__ import annotations

import glob
import json
from pathlib import Path

from megathunder.cli import BENCHMARKS, main
from tests.rollout_helpers import needs_root

REPO = Path(__file__).resolve().parents[2]


@needs_root  # the local runtime: a uid per sandbox
def test_bench_sandbox_reports_each_setup_and_leaves_nothing(capsys, monkeypatch):
    assert BENCHMARKS["sandbox"] == "megathunder.bench.sandbox_ops"
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the servers are processes of their own
    before = set(glob.glob("/tmp/megathunder-bench-sandbox-*"))
    assert main(["bench", "sandbox", "--episodes", "4", "--concurrency", "2", "--commands", "2", "--servers", "0", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert report["bench"] == "sandbox" and list(report["setups"]) == ["local", "1 server"]
    for setup in report["setups"].values():
        assert setup["episodes_per_s"] > 0
        assert (setup["create"]["n"], setup["exec"]["n"], setup["destroy"]["n"]) == (4, 8, 4)
        assert 0 < setup["exec"]["p50_ms"] <= setup["exec"]["p99_ms"]
    assert any(line.startswith("1 server ") for line in out)
    assert set(glob.glob("/tmp/megathunder-bench-sandbox-*")) == before
