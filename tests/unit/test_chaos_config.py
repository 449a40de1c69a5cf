"""``chaos.faults`` is checked at parse time, naming the fault's field."""

from __future__ import annotations

import pytest

from megathunder.config import ConfigError, load_config


@pytest.mark.parametrize("faults,field,words", [
    ("[{kind: kill_server}]", "chaos.faults.0.kind", "deployment=server"),
    ("[{kind: sigusr1, step: 0}, {kind: hang_server, server: 3}]", "chaos.faults.1.server", "2 rollout servers"),
    ("[{kind: fill_disk, step: 10}]", "chaos.faults.0.step", "run.num_steps"),
    ("[{kind: explode}]", "chaos.faults.0.kind", ""),
    ("[{kind: crash_verifier, trajectories: [32]}]", "chaos.faults.0.trajectories", "batch.num_prompts_per_batch"),
    ("[{kind: oom_tool, trajectories: []}]", "chaos.faults.0.trajectories", "one or more"),
    ("[{kind: hang_sandbox, trajectories: [-1]}]", "chaos.faults.0.trajectories", ">= 0"),
    ("[{kind: corrupt_journal, step: 1}]", "chaos.faults.0.step", "run.checkpoint_every"),
    ("[{kind: hang_learner, rank: 0}]", "chaos.faults.0.rank", "greater than or equal to 1"),
    ("[{kind: kill_learner, rank: 2}]", "chaos.faults.0.rank", "world size 2"),
    ("[{kind: hang_sandbox, during: weight_update}]", "chaos.faults.0.during", "kill_engine and hang_engine"),
    ("[{kind: hang_engine, during: push}]", "chaos.faults.0.during", "generation"),
    ("[{kind: oom_tool, trajectories: [0]}]", "chaos.faults.0.kind", "task arithmetic has no bash tool"),
])
def test_bad_faults_are_refused_by_field(faults, field, words):
    extra = ["rollout.engine.deployment=server", "rollout.engine.num_servers=2"] if "server:" in faults else []
    if "rank: 2" in faults:  # the learner's world size is known at parse time only with data_parallel
        extra.append("learner.parallel.data_parallel=2")
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"chaos.faults={faults}", "run.num_steps=3", *extra])
    assert field in str(err.value) and words in str(err.value), str(err.value)


def test_server_faults_parse_for_attached_servers_too():
    """A server the run did not launch is faulted through its dev endpoint (``inject_fault``)."""
    urls = 'rollout.engine.server_urls=["http://127.0.0.1:8100","http://127.0.0.1:8101"]'
    cfg = load_config(None, ["chaos.faults=[{kind: kill_server, step: 1, server: 1}]",
                             "rollout.engine.deployment=server", urls, "run.num_steps=3"])
    assert cfg.chaos.faults[0].server == 1
    with pytest.raises(ConfigError, match="chaos.faults.0.server: 2 >= the run's 2 rollout servers"):
        load_config(None, ["chaos.faults=[{kind: kill_server, step: 1, server: 2}]",
                           "rollout.engine.deployment=server", urls, "run.num_steps=3"])


def test_server_faults_parse_for_launched_servers():
    cfg = load_config(None, ["chaos.faults=[{kind: hang_server, step: 1, after_trajectories: 4, server: 1}]",
                             "rollout.engine.deployment=server", "rollout.engine.num_servers=2", "run.num_steps=3"])
    assert cfg.chaos.faults[0].after_trajectories == 4


def test_tool_faults_parse_on_a_task_with_a_bash_tool():
    cfg = load_config(None, ["chaos.faults=[{kind: hang_sandbox, step: 1, trajectories: [2]}]", "task.name=terminal",
                             "run.num_steps=3"])
    assert cfg.chaos.faults[0].kind == "hang_sandbox"


def test_episode_and_journal_faults_parse():
    cfg = load_config(None, ["chaos.faults=[{kind: hang_verifier, step: 2, trajectories: [0, 31]}, "
                             "{kind: corrupt_journal, step: 2}]", "run.num_steps=3", "run.checkpoint_every=1"])
    assert cfg.chaos.faults[0].trajectories == [0, 31] and cfg.chaos.faults[1].kind == "corrupt_journal"


@pytest.mark.parametrize("kind", ["kill_engine", "hang_engine"])
@pytest.mark.parametrize("overrides,words", [
    (["rollout.engine.deployment=server"], "deployment=in_process"),
    (["schedule.mode=async", "objective.tis=token"], "sync or thunder"),
    (["rollout.engine.max_restarts=0"], "max_restarts >= 1"),
])
def test_in_process_engine_faults_are_refused_where_they_cannot_be_survived_in_place(kind, overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"chaos.faults=[{{kind: {kind}, step: 0, after_trajectories: 3}}]", "run.num_steps=2",
                           *overrides])
    assert "chaos.faults.0.kind" in str(err.value) and words in str(err.value), str(err.value)


@pytest.mark.parametrize("kind", ["kill_engine", "hang_engine"])
def test_in_process_engine_faults_parse_for_the_in_process_engine(kind):
    cfg = load_config(None, [f"chaos.faults=[{{kind: {kind}, step: 1, after_trajectories: 3}}]", "run.num_steps=2"])
    assert cfg.chaos.faults[0].kind == kind and cfg.rollout.engine.max_restarts == 3


def test_learner_faults_parse_and_their_rank_is_checked_against_the_started_world(tmp_path):
    from megathunder.trainer.chaos import check_learner_faults

    cfg = load_config(None, ["chaos.faults=[{kind: hang_learner, step: 1, after_trajectories: 3, rank: 1}]",
                             "run.num_steps=3"])
    fault = cfg.chaos.faults[0]
    assert (fault.kind, fault.rank, fault.after_trajectories) == ("hang_learner", 1, 3)
    check_learner_faults(cfg.chaos.faults, world_size=2)
    with pytest.raises(ConfigError) as err:
        check_learner_faults(cfg.chaos.faults, world_size=1)
    assert "chaos.faults.0.rank" in str(err.value) and "1 rank)" in str(err.value), str(err.value)


class FakeService:
    def __init__(self) -> None:
        self.faults: list[tuple[str, int]] = []

    def control(self, name: str, kind: str, rank: int) -> None:
        assert name == "fault"
        self.faults.append((kind, rank))


def _installed(faults, tmp_path, service):
    from types import SimpleNamespace

    from megathunder.trainer.chaos import Chaos

    chaos = Chaos(faults, tmp_path)
    chaos.trainer = SimpleNamespace(learner=SimpleNamespace(service=service))  # type: ignore[assignment]
    return chaos


def test_learner_faults_are_sent_once_after_their_trajectories(tmp_path):
    faults = load_config(None, ["chaos.faults=[{kind: kill_learner, step: 1, after_trajectories: 2, rank: 1}, "
                                "{kind: hang_learner, step: 2, rank: 3}]", "run.num_steps=3"]).chaos.faults
    service = FakeService()
    chaos = _installed(faults, tmp_path, service)
    chaos.trajectory_finished(0, 5)
    chaos.trajectory_finished(1, 1)
    chaos.after_step(1)  # learner faults are not the after-step kinds
    assert service.faults == []
    chaos.trajectory_finished(1, 2)
    chaos.trajectory_finished(1, 3)
    assert service.faults == [("kill_learner", 1)]
    resumed = _installed(faults, tmp_path, service)
    resumed.trajectory_finished(1, 2)  # fired once per run directory
    resumed.trajectory_finished(2, 1)
    assert service.faults == [("kill_learner", 1), ("hang_learner", 3)]


def test_every_learner_rank_obeys_only_the_fault_that_names_it(monkeypatch):
    """The ``fault`` control (installed with the service on every rank): the named rank signals
    itself (SIGKILL / SIGSTOP), the others do nothing; no control without learner faults."""
    import os
    import signal

    from megathunder.trainer.chaos import learner_controls

    faults = load_config(None, ["chaos.faults=[{kind: kill_learner, step: 1, rank: 1}]", "run.num_steps=3"]).chaos.faults
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    learner_controls(faults, rank=2)["fault"]("kill_learner", 1)
    assert sent == []
    learner_controls(faults, rank=1)["fault"]("hang_learner", 1)
    assert sent == [(os.getpid(), signal.SIGSTOP)]
    assert learner_controls([], rank=1) == {}


@pytest.mark.parametrize("overrides", [["rollout.engine.deployment=server"], ["probe.tokens=0"]])
def test_a_stale_push_needs_the_in_process_engine_and_the_probe_that_catches_it(overrides):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["chaos.faults=[{kind: stale_push, step: 0}]", "run.num_steps=2", *overrides])
    assert "chaos.faults.0.kind" in str(err.value) and "probe.tokens > 0" in str(err.value), str(err.value)
    assert load_config(None, ["chaos.faults=[{kind: stale_push, step: 1}]", "run.num_steps=3"]).chaos.faults[0].step == 1
