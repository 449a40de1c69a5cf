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
