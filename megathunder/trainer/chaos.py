"""Fault injection (``chaos.faults``): the faults RELIABILITY.md says a run survives, made to happen
at a chosen moment of a real run, so recovery can be tried rather than trusted.

Each fault fires once, at the step it names: engine faults (``kill_server``: SIGKILL,
``hang_server``: SIGSTOP of a launched rollout server's process group; ``kill_engine`` /
``hang_engine``: SIGKILL / SIGSTOP of the in-process engine's engine core and workers, once it has
requests in flight: ``InProcessEngine.inject``) when ``after_trajectories`` of the step's
trajectories have finished, while the rest of the batch is still generating; the others after
the step's records are written (``fill_disk``: a file in the run directory grows until the file
system is full, so the next write -- journal, metrics, checkpoint -- meets a real ENOSPC;
``sigusr1`` / ``sigint``: the signal to this process, which stops after the step with a
checkpoint). What the run then does is the recovery under test:
servers' requests move to live ones with their seeds (the same episodes), a dead in-process engine
(a stopped one: once it made no progress for ``rollout.engine.stall_timeout_s``) is started again
with the learner's weights and its requests re-sent with their seeds (the same episodes), a full
disk stops the run with one line and an intact last checkpoint, a signal stops it resumably.

Episode faults hit the episodes of chosen trajectories (``trajectories`` of step ``step``;
``megathunder.rollout.agent_loop.EpisodeFaults``): ``crash_verifier`` / ``hang_verifier`` replace
their verifier with one that raises / sleeps until the pool's ``verifier.timeout_s`` cancels it
(-> ``verifier.on_failure``: the episode's reward changes, recorded in the journal);
``hang_sandbox`` / ``oom_tool`` run a ``bash`` tool call in the episode's sandbox (a local one
built for it when the task has none) after its last turn that sleeps past ``sandbox.wall_time_s``
/ allocates twice ``sandbox.memory_mb``: the tool's result must be an error observation (the
sandbox bounded it; anything else raises and fails the batch), and the episode goes on to its
verifier unchanged. ``corrupt_journal`` tears the journal's last record (the step's own) after
the step and stops the run as a crash there would (:class:`ChaosStop`, exit 130, no checkpoint of
that step): the same command resumes from the last checkpoint, the CRC drops the torn record and
the step is run again.

Learner faults (``kill_learner`` / ``hang_learner``) fire as the server faults do: the learner
service sends rank ``rank`` (> 0) a message of its own between two learner calls, and that rank
SIGKILLs / SIGSTOPs itself on receiving it (``LearnerService.fault``: the rank may be on another
node, so it signals itself). The run then stops -- a dead rank fails rank 0's next collective
(``LearnerRankLost``, exit 1), a stopped one is named by rank 0's watchdog (exit ``LEARNER_HUNG``)
-- and the same command resumes from the last checkpoint.

``stale_push`` makes the push after its step load nothing while the in-process engine stamps the
new version as if it had: the zero-staleness probe must stop the run (exit 1) before the next
batch's gradient is applied (with ``schedule.probe_overlap`` the learner's part of the probe runs
beside that batch's rollout).

What each kind promises (RELIABILITY.md): the rollout-side faults that leave episodes unchanged
(``kill_server``, ``hang_server``, ``kill_engine``, ``hang_engine``, ``hang_sandbox``, ``oom_tool``)
end with the fault-free run's parameters; the others (a verifier fault changes rewards; a stop and
resume) with the replay of the run's own journal.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import time
from pathlib import Path

from megathunder.config import (
    ENGINE_FAULTS,
    EPISODE_FAULTS,
    IN_PROCESS_FAULTS,
    LEARNER_FAULTS,
    ChaosFault,
    ConfigError,
    SandboxConfig,
    VerifierConfig,
)
from megathunder.learner.service import LearnerService
from megathunder.rollout.agent_loop import Verify
from megathunder.rollout.engines.inprocess import InProcessEngine
from megathunder.rollout.engines.server import ServerEngine
from megathunder.rollout.episode import Episode
from megathunder.rollout.sandbox import Sandbox, build_sandbox
from megathunder.rollout.tools import BASH
from megathunder.rollout.types import RolloutEngine
from megathunder.rollout.verifiers import Verdict

log = logging.getLogger(__name__)

AFTER_STEP_FAULTS = ("fill_disk", "sigusr1", "sigint", "corrupt_journal")
"""Faults that fire after the step's records are written (``Chaos.after_step``)."""

FILLER = ".chaos_fill"
"""The file ``fill_disk`` grows in the run directory (delete it to free the space)."""


RECORD = "chaos.jsonl"
"""Faults fired, one JSON line each, written before the fault: a resumed run (the same command)
does not fire them again."""


class ChaosStop(Exception):
    """A fault that stops the run as a crash would (``corrupt_journal``); ``megathunder train``
    prints it in one line and exits 130 (STOPPED_NOW): the same command resumes."""


class ChaosVerifierError(RuntimeError):
    """What ``crash_verifier``'s verifier raises."""


class Chaos:
    def __init__(self, faults: list[ChaosFault], out: Path, engine: RolloutEngine,
                 sandbox: SandboxConfig | None = None, verifier: VerifierConfig | None = None,
                 service: LearnerService | None = None) -> None:
        self.out, self.engine, self.sandbox_cfg, self.verifier_cfg = out, engine, sandbox, verifier
        self.service = service  # learner faults are sent through it
        record = out / RECORD
        fired = [json.loads(line) for line in record.read_text().splitlines()] if record.is_file() else []
        self.pending = [f for i, f in enumerate(faults) if not any(r["index"] == i for r in fired)]
        self._index = {id(f): i for i, f in enumerate(faults)}
        self.rollout_step = -1  # the step whose batch is rolling out (Trainer.rollout)
        self._episode_faults = [f for f in self.pending if f.kind in EPISODE_FAULTS]

    @property
    def has_episode_faults(self) -> bool:
        return bool(self._episode_faults)

    def fires_after(self, step: int) -> bool:
        """A fault not yet fired is to fire after this step's records are written (``after_step``)."""
        return any(f.kind in AFTER_STEP_FAULTS and f.step == step for f in self.pending)

    def stale_push(self, step: int) -> bool:
        """Is the push after ``step`` to load nothing (``stale_push``)? Fires it."""
        return bool(self._due(lambda f: f.kind == "stale_push" and f.step == step))

    def trajectory_finished(self, step: int, num_finished: int) -> None:
        for fault in self._due(lambda f: f.kind in ENGINE_FAULTS + LEARNER_FAULTS and f.step == step
                               and num_finished >= f.after_trajectories):
            if fault.kind in LEARNER_FAULTS:
                self._learner(fault)
            elif fault.kind in IN_PROCESS_FAULTS:
                self._engine(fault)
            else:
                self._server(fault)

    def after_step(self, step: int) -> None:
        for fault in self._due(lambda f: f.kind in AFTER_STEP_FAULTS and f.step == step):
            log.warning("chaos: %s after step %d", fault.kind, step)
            if fault.kind == "fill_disk":
                fill_disk(self.out / FILLER)
            elif fault.kind == "corrupt_journal":
                torn = tear_last_record(self.out / "journal.jsonl")
                raise ChaosStop(f"chaos: corrupt_journal: tore the journal's last record ({torn} bytes cut) after "
                                f"step {step} and stopped as a crash would; the same command resumes from the "
                                "last checkpoint")
            else:
                os.kill(os.getpid(), signal.SIGUSR1 if fault.kind == "sigusr1" else signal.SIGINT)

    # ------------------------------------------------------------------ episode faults (EpisodeFaults)

    def _episode_fault(self, ep: Episode, kinds: tuple[str, ...]) -> ChaosFault | None:
        for fault in self._episode_faults:
            if fault.kind in kinds and fault.step == self.rollout_step and ep.traj_id in fault.trajectories:
                if any(f is fault for f in self.pending):  # recorded when it first hits (fires once per run directory)
                    self._due(lambda f: f is fault)
                return fault
        return None

    async def after_turns(self, ep: Episode, sandbox: Sandbox | None) -> None:
        fault = self._episode_fault(ep, ("hang_sandbox", "oom_tool"))
        if fault is None:
            return
        assert self.sandbox_cfg is not None, "Chaos(sandbox=...) is given by the trainer"
        if fault.kind == "hang_sandbox":
            command = "sleep 3600"
        else:
            command = f"python3 -c 'x = bytearray({2 * self.sandbox_cfg.memory_mb} << 20)'"
        own = sandbox is None
        box = await build_sandbox(self.sandbox_cfg) if sandbox is None else sandbox
        start = time.monotonic()
        try:
            obs = await BASH.run(box, {"command": command})
        finally:
            if own:
                await box.close()
        if "[error:" not in obs:
            raise RuntimeError(f"chaos: {fault.kind}: trajectory {ep.traj_id}'s tool call `{command}` was not "
                               f"stopped by the sandbox: {obs!r}")
        log.warning("chaos: %s in trajectory %d of step %d: %s (%.1f s); the episode goes on", fault.kind,
                    ep.traj_id, self.rollout_step, obs.strip().splitlines()[-1], time.monotonic() - start)

    def verifier(self, ep: Episode, verify: Verify) -> Verify:
        fault = self._episode_fault(ep, ("crash_verifier", "hang_verifier"))
        if fault is None:
            return verify
        step, traj = self.rollout_step, ep.traj_id
        limit = self.verifier_cfg.timeout_s if self.verifier_cfg is not None else 60.0

        async def crash() -> float | Verdict:
            raise ChaosVerifierError(f"chaos: crash_verifier (trajectory {traj} of step {step})")

        async def hang() -> float | Verdict:
            await asyncio.sleep(2 * limit + 60)  # cancelled by the pool at verifier.timeout_s
            raise ChaosVerifierError(f"chaos: hang_verifier outlived verifier.timeout_s={limit:g}")

        log.warning("chaos: %s for trajectory %d of step %d", fault.kind, traj, step)
        return crash if fault.kind == "crash_verifier" else hang

    # ------------------------------------------------------------------

    def _due(self, when) -> list[ChaosFault]:
        due = [f for f in self.pending if when(f)]
        self.pending = [f for f in self.pending if f not in due]
        if due:
            with open(self.out / RECORD, "a") as f:
                for fault in due:
                    f.write(json.dumps({"index": self._index[id(fault)], **fault.model_dump()}) + "\n")
        return due

    def _server(self, fault: ChaosFault) -> None:
        engine = self.engine
        assert isinstance(engine, ServerEngine) and engine.pool is not None, "checked by the config"
        process = engine.pool.servers[fault.server].process
        log.warning("chaos: %s server %d (%s) at step %d", fault.kind, fault.server, engine.urls[fault.server],
                    fault.step)
        os.killpg(process.pid, signal.SIGKILL if fault.kind == "kill_server" else signal.SIGSTOP)

    def _learner(self, fault: ChaosFault) -> None:
        assert self.service is not None, "Chaos(service=...) is given by the trainer"
        log.warning("chaos: %s learner rank %d at step %d", fault.kind, fault.rank, fault.step)
        self.service.fault(fault.kind, fault.rank)  # the rank signals itself as it receives it

    def _engine(self, fault: ChaosFault) -> None:
        engine = self.engine
        assert isinstance(engine, InProcessEngine), "checked by the config"
        log.warning("chaos: %s at step %d (during %s)", fault.kind, fault.step, fault.during.replace("_", " "))
        engine.inject(signal.SIGKILL if fault.kind == "kill_engine" else signal.SIGSTOP, during=fault.during)


def check_learner_faults(faults: list[ChaosFault], world_size: int) -> None:
    """Each learner fault's rank exists in this learner world (known only once it is started)."""
    for i, fault in enumerate(faults):
        if fault.kind in LEARNER_FAULTS and fault.rank >= world_size:
            raise ConfigError(f"chaos.faults.{i}.rank: {fault.rank} is not a learner rank other than 0 (the "
                              f"learner's world has {world_size} rank{'s' if world_size > 1 else ''})")


def tear_last_record(path: Path) -> int:
    """Cut the last line of ``path`` in half, as a crash mid-write would leave it; returns the bytes cut."""
    data = path.read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    keep = start + (len(data) - start) // 2
    with open(path, "r+b") as f:
        f.truncate(keep)
    return len(data) - keep


def fill_disk(path: Path) -> int:
    """Grow ``path`` until its file system has no space left; returns the bytes written."""
    written, chunk = 0, 1 << 24
    with open(path, "ab", buffering=0) as f:
        while chunk:
            try:
                written += f.write(b"\0" * chunk)
            except OSError as err:
                if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                chunk //= 2
    return written
