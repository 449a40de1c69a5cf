"""``chaos.faults`` is checked at parse time, naming the fault's field."""

from __future__ import annotations

import pytest

from megathunder.config import ConfigError, load_config


@pytest.mark.parametrize("faults,field,words", [
    ("[{kind: kill_server}]", "chaos.faults.0.kind", "deployment=server"),
    ("[{kind: sigusr1, step: 0}, {kind: hang_server, server: 3}]", "chaos.faults.1.server", "num_servers"),
    ("[{kind: fill_disk, step: 10}]", "chaos.faults.0.step", "run.num_steps"),
    ("[{kind: explode}]", "chaos.faults.0.kind", ""),
    ("[{kind: crash_verifier, trajectories: [32]}]", "chaos.faults.0.trajectories", "batch.num_prompts_per_batch"),
    ("[{kind: oom_tool, trajectories: []}]", "chaos.faults.0.trajectories", "one or more"),
    ("[{kind: hang_sandbox, trajectories: [-1]}]", "chaos.faults.0.trajectories", ">= 0"),
    ("[{kind: corrupt_journal, step: 1}]", "chaos.faults.0.step", "run.checkpoint_every"),
])
def test_bad_faults_are_refused_by_field(faults, field, words):
    extra = ["rollout.engine.deployment=server", "rollout.engine.num_servers=2"] if "server:" in faults else []
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"chaos.faults={faults}", "run.num_steps=3", *extra])
    assert field in str(err.value) and words in str(err.value), str(err.value)


def test_server_faults_parse_for_launched_servers():
    cfg = load_config(None, ["chaos.faults=[{kind: hang_server, step: 1, after_trajectories: 4, server: 1}]",
                             "rollout.engine.deployment=server", "rollout.engine.num_servers=2", "run.num_steps=3"])
    assert cfg.chaos.faults[0].after_trajectories == 4


def test_episode_and_journal_faults_parse():
    cfg = load_config(None, ["chaos.faults=[{kind: hang_verifier, step: 2, trajectories: [0, 31]}, "
                             "{kind: corrupt_journal, step: 2}]", "run.num_steps=3", "run.checkpoint_every=1"])
    assert cfg.chaos.faults[0].trajectories == [0, 31] and cfg.chaos.faults[1].kind == "corrupt_journal"


@pytest.mark.parametrize("overrides,words", [
    (["rollout.engine.deployment=server"], "deployment=in_process"),
    (["schedule.mode=async", "objective.tis=token"], "sync or thunder"),
    (["rollout.engine.max_restarts=0"], "max_restarts >= 1"),
])
def test_kill_engine_is_refused_where_it_cannot_be_survived_in_place(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["chaos.faults=[{kind: kill_engine, step: 0, after_trajectories: 3}]", "run.num_steps=2",
                           *overrides])
    assert "chaos.faults.0.kind" in str(err.value) and words in str(err.value), str(err.value)


def test_kill_engine_parses_for_the_in_process_engine():
    cfg = load_config(None, ["chaos.faults=[{kind: kill_engine, step: 1, after_trajectories: 3}]", "run.num_steps=2"])
    assert cfg.chaos.faults[0].kind == "kill_engine" and cfg.rollout.engine.max_restarts == 3
