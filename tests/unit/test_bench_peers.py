"""``megathunder bench peers``: the workload handed to TRL is the megathunder run's, field by field,
and a workload TRL cannot match is refused by field name before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megathunder.bench import peers
from megathunder.config import ConfigError, load_config

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs/quickstart.yaml")


def test_the_quickstart_maps_field_by_field() -> None:
    cfg = load_config(QUICKSTART, ["learner.optimizer.weight_decay=0.01", "learner.optimizer.adam_beta2=0.95"])
    a = peers.trl_arguments(cfg)
    assert a["per_device_train_batch_size"] == 20 * 8 and a["num_generations"] == 8
    assert a["gradient_accumulation_steps"] == 1 and a["steps_per_generation"] == 1 and a["num_iterations"] == 1
    assert a["max_completion_length"] == 8 and a["temperature"] == 1.0 and a["top_k"] == 0
    assert (a["learning_rate"], a["weight_decay"], a["adam_beta2"], a["max_grad_norm"]) == (1e-3, 0.01, 0.95, 1.0)
    assert a["lr_scheduler_type"] == "constant" and a["optim"] == "adamw_torch"
    assert (a["loss_type"], a["scale_rewards"], a["beta"]) == ("dapo", "group", 0.0)
    assert a["shuffle_dataset"] is False and a["bf16"] is False and a["gradient_checkpointing"] is False


@pytest.mark.parametrize(("override", "field"), [
    ("task.name=calculator", "task.name"),
    ("agent.max_turns=3", "task.name"),
    ("objective.advantage=rloo", "objective.advantage"),
    ("objective.loss_agg=seq_mean_token_sum", "objective.loss_agg"),
    ("objective.entropy_coef=0.01", "objective.entropy_coef"),
    ("learner.optimizer.lr_decay_style=cosine", "learner.optimizer.lr_decay_style"),
])
def test_a_workload_trl_cannot_match_is_refused_by_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        peers.trl_arguments(load_config(QUICKSTART, [override]))


def test_the_command_refuses_before_running_anything(capsys) -> None:
    assert peers.main(["--config", QUICKSTART, "objective.advantage=rloo"]) == 2
    assert "objective.advantage" in capsys.readouterr().err


def test_trl_accepts_the_arguments(tmp_path) -> None:
    """Every keyword exists in the pinned TRL and passes its own validation."""
    import trl  # the test extra installs it (peers): a missing TRL is a broken set-up, not a skip

    args = trl.GRPOConfig(output_dir=str(tmp_path), max_steps=2, use_cpu=True,
                          **peers.trl_arguments(load_config(QUICKSTART)))
    assert args.generation_batch_size == 160 and args.num_generations == 8


def test_rounds_alternate_the_order_and_report_the_median_of_per_round_ratios(monkeypatch, tmp_path, capsys) -> None:
    """Each round's systems against that round's TRL; the ratio printed is the median over rounds.
    The first run warm-starts the model every later run (TRL's too) starts from."""
    steps = {("round0", "sync"): 2.0, ("round0", "trl"): 4.0,   # 0.5
             ("round1", "trl"): 2.0, ("round1", "sync"): 1.6,   # 0.8
             ("round2", "sync"): 3.0, ("round2", "trl"): 5.0}   # 0.6
    calls = []

    def fake_train(config, out, overrides):
        calls.append((out.parent.name, out.name, [o for o in overrides if o.startswith(("sft.", "learner.model"))]))
        (out / "sft_model").mkdir(parents=True)
        rows = [{"step": k, "step_s": s, "reward_mean": 0.5} for k, s in enumerate([9.0, steps[out.parent.name, "sync"]])]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {}

    def fake_trl(config, overrides, model, num_steps, out):
        calls.append((out.parent.name, out.name, [str(model)]))
        return {"step_s": [9.0, steps[out.parent.name, "trl"]], "reward_mean": [0.25, 0.5]}

    monkeypatch.setattr(peers, "_train", fake_train)
    monkeypatch.setattr(peers, "run_trl", fake_trl)
    assert peers.main(["--config", QUICKSTART, "--systems", "sync", "trl", "--rounds", "3", "--steps", "2",
                       "--out", str(tmp_path)]) == 0
    model = str(tmp_path / "round0" / "sync" / "sft_model")
    assert calls == [("round0", "sync", []), ("round0", "trl", [model]),  # the config's own SFT first
                     ("round1", "trl", [model]), ("round1", "sync", [f"learner.model.hf_checkpoint={model}", "sft.num_steps=0"]),
                     ("round2", "sync", [f"learner.model.hf_checkpoint={model}", "sft.num_steps=0"]), ("round2", "trl", [model])]
    out = capsys.readouterr().out
    assert "sync/trl step time: 0.60x (median of 3 rounds: 0.50 0.80 0.60)" in out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["sync"]["rounds_step_s"] == [2.0, 1.6, 3.0] and report["sync"]["step_s"] == 2.0
