"""``megathunder bench peers`` end to end, small: a sync run and TRL's ``GRPOTrainer`` (from the
``peers`` extra) on the same quickstart workload. TRL is handed the model the sync run trained from
and, at every step, exactly the prompts the trainer drew for that step, each once per sample; both
report a time and a mean reward per step. (Which is faster is a benchmark: BENCHMARKS.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from megathunder.config import load_config
from megathunder.rollout.tasks import build_task
from megathunder.rollout.tasks.split import step_instances
from tests.integration.test_trainer import ENV, ROOT

STEPS, PROMPTS, SAMPLES = 2, 3, 2


@pytest.mark.slow  # a benchmark's peer (TRL), none of megathunder's own claims
def test_trl_trains_on_the_same_workload_as_the_sync_run(tmp_path):
    overrides = [f"batch.num_prompts_per_batch={PROMPTS}", f"batch.samples_per_prompt={SAMPLES}", "sft.num_steps=2"]
    cmd = [sys.executable, "-m", "megathunder.cli", "bench", "peers", "--steps", str(STEPS),
           "--systems", "sync", "trl", "--out", str(tmp_path), *overrides]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for system in ("sync", "trl"):
        assert len(report[system]["step_times"]) == STEPS and len(report[system]["reward_mean"]) == STEPS, system
        assert all(0.0 <= r <= 1.0 for r in report[system]["reward_mean"]), system

    spec = json.loads((tmp_path / "trl" / "spec.json").read_text())
    assert spec["model"] == str(tmp_path / "sync" / "sft_model")  # the model the sync run trained from
    cfg = load_config(ROOT / "configs/quickstart.yaml", overrides)
    task = build_task(cfg.task)
    seen = json.loads((tmp_path / "trl" / "trl.json").read_text())["instances"]
    assert len(seen) == STEPS
    for step, ids in enumerate(seen):
        drawn = [inst.instance_id for inst in step_instances(cfg, task, step)]
        assert Counter(ids) == Counter({i: SAMPLES for i in drawn}), step
