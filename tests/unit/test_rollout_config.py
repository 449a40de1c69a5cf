"""The rollout side's config sections: bounds and cross-field rules name the field."""

from __future__ import annotations

import pytest

from megathunder.config import ConfigError, load_config


def test_defaults_and_overrides():
    cfg = load_config(
        None, ["task.name=swe_local", "sandbox.isolation=unshare", "verifier.on_failure=drop_group"]
    )
    assert cfg.task.name == "swe_local" and cfg.sandbox.isolation == "unshare"
    assert cfg.verifier.on_failure == "drop_group" and cfg.agent.max_turns == 8


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["agent.max_turns=0"], "agent.max_turns"),
        (["agent.max_new_tokens_per_turn=4096"], "agent.max_new_tokens_per_turn"),
        (["sandbox.backend=lxc"], "sandbox.backend"),
        (["sandbox.memory_mb=8"], "sandbox.memory_mb"),
        (["sandbox.cgroup=maybe"], "sandbox.cgroup"),
        (["sandbox.cpu_time_s=10000", "sandbox.wall_time_s=1"], "sandbox.cpu_time_s"),
        (["sandbox.cli=podman"], "sandbox.cli"),
        (["sandbox.num_uids=4", "agent.max_concurrent_episodes=8"], "sandbox.num_uids"),
        (["verifier.timeout_s=0"], "verifier.timeout_s"),
        (["verifier.on_failure=retry"], "verifier.on_failure"),
        (["task.name=swe_bench"], "task.path"),
        (["task.path=x.jsonl"], "task.path"),
        (["task.name=swe_bench", "task.path=x.jsonl"], "sandbox.backend"),
        (["agent.max_turnz=3"], "agent.max_turnz"),
        (["task.name=swe_local", "sandbox.backend=podman"], "sandbox.image"),
        (["sandbox.backend=enroot", "sandbox.runtime_args=[--debug]"], "sandbox.runtime_args"),
    ],
)
def test_bad_rollout_configs_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert f"\n  {field}" in str(err.value), str(err.value)


def test_dataset_task_with_container_backend_is_valid():
    cfg = load_config(
        None, ["task.name=swe_bench", "task.path=v.parquet", "sandbox.backend=apptainer"]
    )
    assert cfg.sandbox.backend == "apptainer"
    cfg = load_config(None, ["task.name=swe_local", "sandbox.backend=podman", "sandbox.image=b:1"])
    assert cfg.sandbox.image == "b:1"
