"""Configuration: YAML + overrides, every failure names its dotted field, before anything runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megathunder.config import ConfigError, load_config, parse_overrides

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    load_config(path)


def test_overrides_are_typed_and_nested():
    cfg = load_config(None, ["objective.kl_coef=1e-3", "ledger.max_group_slots=null", "run.seed=7"])
    assert cfg.objective.kl_coef == 1e-3
    assert cfg.ledger.max_group_slots is None
    assert cfg.run.seed == 7
    assert parse_overrides(["a.b.c=true"]) == {"a": {"b": {"c": True}}}


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["objective.klcoef=0.1"], "objective.klcoef"),
        (["objective.kl_coef=lots"], "objective.kl_coef"),
        (["objective.kl_coef=-1"], "objective.kl_coef"),
        (["objective.advantage=ppo"], "objective.advantage"),
        (["ledger.max_group_slots=-1"], "ledger.max_group_slots"),
        (["objective.loss_agg=seq_mean_token_sum_norm"], "objective.loss_agg_norm_tokens"),
        (["exactness.model.hidden_size=30", "exactness.model.num_heads=4"], "exactness.model.hidden_size"),
        (["objective.num_ppo_epochs=2"], "objective.num_ppo_epochs"),
        (["objective.num_minibatches_per_batch=4"], "objective.num_minibatches_per_batch"),
        (["objective.ppo_old_logprobs=rollout"], "objective.ppo_old_logprobs"),
        (["schedule.mode=async"], "objective.tis"),
        (["schedule.mode=fully_async"], "objective.tis"),
        (["schedule.mode=async", "objective.tis=token", "objective.ppo_old_logprobs=rollout"], "objective.tis"),
        (["objective.policy_loss=gspo", "objective.clip_ratio_c=3"], "objective.clip_ratio_c"),
        (["objective.clip_ratio_c=1.0"], "objective.clip_ratio_c"),
        (["objective.entropy_quantile_mask=0.2"], "objective.entropy_quantile_mask"),
        (["batch.max_refill_groups=2"], "batch.max_refill_groups"),  # nothing is ever dropped
        (["batch.max_refill_groups=-1"], "batch.max_refill_groups"),
        (["nonsense.key=1"], "nonsense"),
    ],
)
def test_bad_configs_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert f"\n  {field}" in str(err.value)


def test_non_streamable_settings_are_fine_outside_thunder():
    cfg = load_config(None, ["schedule.mode=sync", "objective.num_ppo_epochs=4"])
    assert cfg.objective.num_ppo_epochs == 4
    cfg = load_config(None, ["schedule.mode=async", "objective.ppo_old_logprobs=rollout"])
    assert cfg.objective.needs_old_logprobs
    cfg = load_config(None, ["schedule.mode=fully_async", "objective.allow_uncorrected_off_policy=true"])
    assert cfg.objective.tis == "none"


def test_malformed_override_and_file(tmp_path):
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(None, ["objective.kl_coef"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_cli_config_prints_resolved_config_and_rejects_bad_ones():
    ok = subprocess.run(
        [sys.executable, "-m", "megathunder.cli", "config", str(CONFIGS / "grpo_exactness.yaml"),
         "ledger.max_group_slots=3"],
        capture_output=True, text=True, check=True,
    )
    assert "max_group_slots: 3" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "megathunder.cli", "config", str(CONFIGS / "grpo_exactness.yaml"),
         "objective.num_ppo_epochs=2"],
        capture_output=True, text=True,
    )
    assert bad.returncode == 2
    assert "objective.num_ppo_epochs" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "configs").glob("*.yaml")) + [None],
                         ids=lambda p: getattr(p, "name", "defaults"))
def test_a_run_s_saved_config_loads_back_unchanged(path, tmp_path):
    """A run saves its resolved config with every field listed (``config.yaml``); ``megathunder
    replay`` and resume load it again: no check may depend on whether a field was given
    explicitly (one did, and replay refused every saved config)."""
    import yaml

    cfg = load_config(path)
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    assert load_config(saved) == cfg


def test_option_names_that_yaml_1_1_reads_as_booleans_stay_names(tmp_path):
    """``off`` / ``on`` / ``yes`` / ``no`` are option names here, as YAML 1.2 reads them (PyYAML's 1.1
    made ``sandbox.cgroup=off`` a boolean and refused it); true / false stay booleans."""
    from megathunder.config import load_config

    cfg = load_config(None, ["sandbox.cgroup=off", "ledger.per_turn_scores=off", "run.progress=false"])
    assert cfg.sandbox.cgroup == "off" and cfg.ledger.per_turn_scores == "off" and cfg.run.progress is False
    path = tmp_path / "c.yaml"
    path.write_text("sandbox:\n  cgroup: off\nrun:\n  progress: False\n")
    cfg = load_config(path, [])
    assert cfg.sandbox.cgroup == "off" and cfg.run.progress is False
