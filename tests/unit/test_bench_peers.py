"""``megathunder bench peers``: the workload handed to TRL is the megathunder run's, field by field,
and a workload TRL cannot match is refused by field name before anything runs."""

from __future__ import annotations

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
