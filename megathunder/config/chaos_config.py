"""The ``chaos`` section: faults injected into a run (``megathunder.trainer.chaos``), for soak tests
and for trying recovery (RELIABILITY.md). Its cross-section rules are ``megathunder.config.rules``'
chaos group."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from megathunder.config.base import Strict

EPISODE_FAULTS = ("crash_verifier", "hang_verifier", "hang_sandbox", "oom_tool")
"""Faults of chosen trajectories' episodes (``trajectories`` of step ``step``)."""
SERVER_FAULTS = ("kill_server", "hang_server")
"""Faults of the rollout engine, when ``after_trajectories`` of step ``step``'s trajectories have finished."""
IN_PROCESS_FAULTS = ("kill_engine", "hang_engine")
"""Faults of the in-process engine, fired as the server faults are; survived by a restart in place."""
ENGINE_FAULTS = (*SERVER_FAULTS, *IN_PROCESS_FAULTS)
LEARNER_FAULTS = ("kill_learner", "hang_learner")
"""Faults of a learner rank > 0, fired as the server faults are (``after_trajectories`` of ``step``)."""


class ChaosFault(Strict):
    """One fault injected into a run (``megathunder.trainer.chaos``)."""

    kind: Literal["fill_disk", "sigusr1", "sigint", "kill_server", "hang_server", "kill_engine", "hang_engine",
                  "crash_verifier", "hang_verifier", "hang_sandbox", "oom_tool", "corrupt_journal", "kill_learner",
                  "hang_learner", "stale_push"]
    """fill_disk: fill the run directory's file system (the next write fails); sigusr1 / sigint: the
    signal to this process (stop after the step, checkpoint, exit 75); kill_server / hang_server:
    SIGKILL / SIGSTOP rollout server ``server``'s process group (deployment=server, launched here);
    kill_engine / hang_engine: SIGKILL / SIGSTOP the in-process engine's engine core and its workers
    (deployment=in_process; restarted in place, ``rollout.engine.max_restarts``: the stopped one once
    its requests made no progress for ``rollout.engine.stall_timeout_s``);
    crash_verifier / hang_verifier: the verifier of ``trajectories`` raises / sleeps past
    ``verifier.timeout_s`` (-> ``verifier.on_failure``); hang_sandbox / oom_tool: the episode's own
    first ``bash`` tool call runs instead a command that sleeps past ``sandbox.wall_time_s`` /
    allocates twice ``sandbox.memory_mb`` (its result must be an error observation; the episode
    goes on with it; the task needs a bash tool); corrupt_journal: the journal's
    last record (the step's) is torn after the step, and the run stops as a crash would (exit 130,
    no checkpoint of that step); kill_learner / hang_learner: learner rank ``rank`` SIGKILLs /
    SIGSTOPs itself as it receives the learner's next message (the run stops: rank 0 names the
    dead rank, exit 1, or its watchdog the hung one, exit 86, within
    ``learner.watchdog.heartbeat_timeout_s``; the same command resumes); stale_push: the push after
    step ``step`` loads nothing, but the in-process engine stamps the new version as if it had (a
    transfer that silently failed): the probe must stop the run (exit 1) before the next batch's
    gradient is applied."""
    step: int = Field(0, ge=0)
    """The optimizer step during (server, learner and episode faults) or after (the others) which it happens."""
    after_trajectories: int = Field(0, ge=0)
    """Engine faults (kill_server, hang_server, kill_engine, hang_engine) and learner faults: when this many of the
    step's trajectories have finished."""
    during: Literal["generation", "weight_update"] = "generation"
    """kill_engine / hang_engine: ``generation`` -- while requests are in flight outside a weight
    update (survived in place); ``weight_update`` -- as the weight update after that moment begins
    (the step's push: not survived in place; the update fails, the run stops in one line, exit 1,
    and the same command resumes from the last checkpoint)."""
    server: int = Field(0, ge=0)
    rank: int = Field(1, ge=1)
    """Learner faults: the learner rank that dies or hangs (not 0: rank 0 is the controller, whose
    loss ends the run on every rank anyway); below the learner's world size (checked at start)."""
    trajectories: list[int] = Field(default_factory=lambda: [0])
    """Episode faults: the trajectory ids (in the step's batch: group g's sample k is g x
    samples_per_prompt + k) whose episodes get the fault."""

    @field_validator("during")
    @classmethod
    def _check_during(cls, value: str, info: ValidationInfo) -> str:
        kind = info.data.get("kind")
        if value != "generation" and kind not in IN_PROCESS_FAULTS:
            raise ValueError(f"{value} is for {' and '.join(IN_PROCESS_FAULTS)} (not {kind})")
        return value

    @field_validator("trajectories")
    @classmethod
    def _check_trajectories(cls, value: list[int]) -> list[int]:
        if not value or any(t < 0 for t in value):
            raise ValueError(f"{value}: one or more trajectory ids, each >= 0")
        return value


class ChaosConfig(Strict):
    """Faults to inject, for soak tests and for trying recovery (RELIABILITY.md); none by default."""

    faults: list[ChaosFault] = []
