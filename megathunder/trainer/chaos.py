"""Fault injection (``chaos.faults``): the faults RELIABILITY.md says a run survives, made to happen
at a chosen moment of a real run, so recovery can be tried rather than trusted. Nothing of it is in
the product's classes: ``Chaos.install`` wraps the trainer's parts at start (its rollout, the agent
loop's event sink, verifiers and ``bash`` tool, the weight sync, an after-step hook), and the
learner ranks take the learner faults as a control message installed with their service
(``learner_controls``).

Each fault fires once, at the step it names: engine faults (``kill_server``: SIGKILL,
``hang_server``: SIGSTOP of a launched rollout server's process group; ``kill_engine`` /
``hang_engine``: SIGKILL / SIGSTOP of the in-process engine's engine core and workers, once it has
requests in flight: ``InProcessEngine.inject``, the engine's one fault port, which can act inside
its update lock) when ``after_trajectories`` of the step's trajectories have finished, while the
rest of the batch is still generating; the others after the step's records are written
(``fill_disk``: a file in the run directory grows until the file system is full, so the next
write -- journal, metrics, checkpoint -- meets a real ENOSPC; ``sigusr1`` / ``sigint``: the signal
to this process, which stops after the step with a checkpoint). What the run then does is the
recovery under test: servers' requests move to live ones with their seeds (the same episodes), a
dead in-process engine (a stopped one: once it made no progress for
``rollout.engine.stall_timeout_s``) is started again with the learner's weights and its requests
re-sent with their seeds (the same episodes), a full disk stops the run with one line and an
intact last checkpoint, a signal stops it resumably.

Episode faults hit the episodes of chosen trajectories (``trajectories`` of step ``step``; the
episode a call belongs to is ``megathunder.rollout.episode.CURRENT_EPISODE``): ``crash_verifier`` /
``hang_verifier`` replace their verifier with one that raises / sleeps until the pool's
``verifier.timeout_s`` cancels it (-> ``verifier.on_failure``: the episode's reward changes,
recorded in the journal); ``hang_sandbox`` / ``oom_tool`` take the episode's own first ``bash``
tool call (the task must have one) and run instead a command that sleeps past
``sandbox.wall_time_s`` / allocates twice ``sandbox.memory_mb``: the sandbox must stop it (an error
observation; anything else raises and fails the batch), and the episode goes on with that
observation in its transcript -- its trajectory changes. ``corrupt_journal`` tears the journal's
last record (the step's own) after the step and stops the run as a crash there would
(:class:`ChaosStop`, exit 130, no checkpoint of that step): the same command resumes from the
last checkpoint, the CRC drops the torn record and the step is run again.

Learner faults (``kill_learner`` / ``hang_learner``) fire as the server faults do: the learner
service sends every rank a ``fault`` control between two learner calls, and the rank it names
SIGKILLs / SIGSTOPs itself on receiving it (the rank may be on another node, so it signals
itself). The run then stops -- a dead rank fails rank 0's next collective (``LearnerRankLost``,
exit 1), a stopped one is named by rank 0's watchdog (exit ``LEARNER_HUNG``) -- and the same
command resumes from the last checkpoint.

``stale_push`` makes the push after its step load nothing while the in-process engine stamps the
new version as if it had (``StalePush``): the zero-staleness probe must stop the run (exit 1)
before the next batch's gradient is applied (with ``probe.overlap`` the learner's part of the
probe runs beside that batch's rollout).

What each kind promises (RELIABILITY.md): the engine and server faults leave the episodes
unchanged (re-sent requests sample the same tokens with their seeds: on CPU) and end with the
fault-free run's parameters; the others change the episodes (a verifier's reward, a tool's
observation) or stop and resume, and end with the replay of the run's own journal -- the batch
update of the episodes as they happened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, cast

from megathunder.config import (
    ENGINE_FAULTS,
    EPISODE_FAULTS,
    IN_PROCESS_FAULTS,
    LEARNER_FAULTS,
    ChaosFault,
    ConfigError,
    SandboxConfig,
    VerifierConfig,
    sandbox_runtime,
)
from megathunder.rollout.agent_loop import AgentLoop
from megathunder.rollout.engines.inprocess import InProcessEngine
from megathunder.rollout.engines.server import ServerEngine
from megathunder.rollout.episode import CURRENT_EPISODE, Episode, RolloutEvent
from megathunder.rollout.sandbox import Sandbox
from megathunder.rollout.tools import BASH
from megathunder.rollout.verifiers import RewardOutcome, Verdict, VerifierPool
from megathunder.trainer.trainer import Trainer

log = logging.getLogger(__name__)

AFTER_STEP_FAULTS = ("fill_disk", "sigusr1", "sigint", "corrupt_journal")
"""Faults that fire after the step's records are written (``Chaos.__call__``, an after-step hook)."""

TOOL_FAULTS = ("hang_sandbox", "oom_tool")
"""Faults of an episode's own ``bash`` tool call."""

FAULT_SIGNALS = {"kill_learner": signal.SIGKILL, "hang_learner": signal.SIGSTOP}

FILLER = ".chaos_fill"
"""The file ``fill_disk`` grows in the run directory (delete it to free the space)."""


RECORD = "chaos.jsonl"
"""Faults fired, one JSON line each, written before the fault: a resumed run (the same command)
does not fire them again."""

Verify = Callable[[], Awaitable[float | Verdict]]


class ChaosStop(Exception):
    """A fault that stops the run as a crash would (``corrupt_journal``); ``megathunder train``
    prints it in one line and exits 130 (STOPPED_NOW): the same command resumes."""


class ChaosVerifierError(RuntimeError):
    """What ``crash_verifier``'s verifier raises."""


def learner_controls(faults: list[ChaosFault], rank: int) -> dict[str, Callable[..., None]]:
    """Every learner rank's part in the learner faults: a ``fault`` control
    (``LearnerService.control``) that the rank it names obeys by signalling itself (the rank may be
    on another node). Installed at the service's construction; none without learner faults."""
    if not any(f.kind in LEARNER_FAULTS for f in faults):
        return {}

    def fault(kind: str, target: int) -> None:
        if target == rank:  # this rank dies or hangs, as injected
            os.kill(os.getpid(), FAULT_SIGNALS[kind])

    return {"fault": fault}


class Chaos:
    """The faults of a run (module docstring), installed around the trainer's parts (``install``);
    each fires once, recorded in the run directory's ``chaos.jsonl``."""

    def __init__(self, faults: list[ChaosFault], out: Path) -> None:
        self.out = out
        record = out / RECORD
        fired = [json.loads(line) for line in record.read_text().splitlines()] if record.is_file() else []
        self.pending = [f for i, f in enumerate(faults) if not any(r["index"] == i for r in fired)]
        self._index = {id(f): i for i, f in enumerate(faults)}
        self.rollout_step = -1  # the step whose batch is rolling out (the trainer's rollout, wrapped)
        self._episode_faults = [f for f in self.pending if f.kind in EPISODE_FAULTS]
        self._finished: dict[int, int] = {}  # trajectories finished, per step
        self._tool_hit: set[tuple[int, int]] = set()  # (step, trajectory) whose bash call a tool fault took
        self._injecting: asyncio.Future[None] | None = None  # a server fault on its way
        self.trainer: Trainer | None = None
        self.memory_mb, self.verifier_timeout_s = 1024, 60.0  # the sandbox's and the verifiers' (install)

    # ------------------------------------------------------------------ installed

    def install(self, tr: Trainer) -> None:
        """Wrap the trainer's parts the faults act through: its rollout (the step rolling out), the
        agent loop's events (engine, server and learner faults fire after ``after_trajectories``
        have finished), its verifiers and ``bash`` tool (episode faults), the weight sync
        (``stale_push``); and the after-step hook (the others)."""
        self.trainer = tr
        self.install_episodes(tr.agent_loop, tr.cfg.sandbox, tr.cfg.verifier)
        rollout = tr.rollout

        async def rollout_of_step(step: int, stream: bool = False) -> list[Episode]:
            self.rollout_step = step
            return await rollout(step, stream)

        tr.rollout = rollout_of_step  # type: ignore[method-assign]
        tr.agent_loop.emit = self._observing(tr.agent_loop.emit)
        if any(f.kind == "stale_push" for f in self.pending):
            tr.weights = StalePush(tr.weights, tr.engine, self)  # type: ignore[assignment]
        tr.records.after_step.append(self)

    def install_episodes(self, loop: AgentLoop, sandbox: SandboxConfig, verifier: VerifierConfig) -> None:
        """The episode faults' part: the agent loop's verifiers and ``bash`` tool wrapped."""
        self.memory_mb, self.verifier_timeout_s = sandbox_runtime(sandbox).memory_mb, verifier.timeout_s
        tool_faults = [i for i, f in enumerate(self.pending) if f.kind in TOOL_FAULTS]
        if tool_faults and BASH.name not in loop.tools:
            i = tool_faults[0]
            raise ConfigError(f"chaos.faults.{i}.kind: {self.pending[i].kind} hits an episode's own bash tool call; "
                              f"task {loop.task.name!r} has no bash tool")
        if self._episode_faults:
            loop.verifiers = FaultyVerifiers(loop.verifiers, self)  # type: ignore[assignment]
        if tool_faults:
            bash = loop.tools[BASH.name]
            loop.tools[BASH.name] = dataclasses.replace(bash, run=functools.partial(self._tool_call, bash))

    def _observing(self, emit: Callable[[RolloutEvent], None]) -> Callable[[RolloutEvent], None]:
        def observe(event: RolloutEvent) -> None:
            if event.kind == "trajectory_finished" and self.pending and self.trainer is not None:
                self.trainer.learner.flush()  # a learner fault fires after the events before it, as they happened
                version = self.trainer.version
                self._finished[version] = self._finished.get(version, 0) + 1
                self.trajectory_finished(version, self._finished[version])
            emit(event)

        return observe

    # ------------------------------------------------------------------ after-step hook (StepRecords)

    def __call__(self, step: int) -> None:
        self.after_step(step)

    def acts_after(self, step: int) -> bool:
        """A fault not yet fired is to fire after this step's records are written."""
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

    # ------------------------------------------------------------------ episode faults

    def episode_fault(self, ep: Episode | None, kinds: tuple[str, ...]) -> ChaosFault | None:
        """The fault of ``kinds`` that hits ``ep`` (of the step rolling out), recorded as it first hits."""
        if ep is None:
            return None
        for fault in self._episode_faults:
            if fault.kind in kinds and fault.step == self.rollout_step and ep.traj_id in fault.trajectories:
                if any(f is fault for f in self.pending):  # recorded when it first hits (fires once per run directory)
                    self._due(lambda f: f is fault)
                return fault
        return None

    async def _tool_call(self, bash, sandbox: Sandbox | None, args: Mapping[str, str]) -> str:
        """The episode's own ``bash`` call, its command replaced by the fault's (``hang_sandbox``: one
        that sleeps past ``sandbox.wall_time_s``; ``oom_tool``: one that allocates twice
        ``sandbox.memory_mb``) the first time a faulted episode calls it: the sandbox must stop it,
        and the episode goes on with the error observation in its transcript."""
        ep = CURRENT_EPISODE.get(None)
        key = None if ep is None else (self.rollout_step, ep.traj_id)
        fault = None if key is None or key in self._tool_hit else self.episode_fault(ep, TOOL_FAULTS)
        if fault is None or ep is None or key is None:
            return await bash.run(sandbox, args)
        self._tool_hit.add(key)  # its first bash call only
        command = ("sleep 3600" if fault.kind == "hang_sandbox"
                   else f"python3 -c 'x = bytearray({2 * self.memory_mb} << 20)'")
        start = time.monotonic()
        obs = await bash.run(sandbox, {"command": command})
        if "[error:" not in obs:
            raise RuntimeError(f"chaos: {fault.kind}: trajectory {ep.traj_id}'s tool call `{command}` was not "
                               f"stopped by the sandbox: {obs!r}")
        log.warning("chaos: %s in trajectory %d of step %d: %s (%.1f s); the episode goes on with it", fault.kind,
                    ep.traj_id, self.rollout_step, obs.strip().splitlines()[-1], time.monotonic() - start)
        return obs

    def verifier(self, ep: Episode | None, verify: Verify) -> Verify:
        fault = self.episode_fault(ep, ("crash_verifier", "hang_verifier"))
        if fault is None or ep is None:
            return verify
        step, traj = self.rollout_step, ep.traj_id
        limit = self.verifier_timeout_s

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
        assert self.trainer is not None
        engine = self.trainer.engine
        assert isinstance(engine, ServerEngine), "checked by the config"
        how = "its process group" if engine.pool is not None else "its dev endpoint"
        log.warning("chaos: %s server %d (%s, through %s) at step %d", fault.kind, fault.server,
                    engine.urls[fault.server], how, fault.step)
        self._injecting = asyncio.ensure_future(engine.inject_fault(fault.server, fault.kind))

    def _learner(self, fault: ChaosFault) -> None:
        assert self.trainer is not None
        log.warning("chaos: %s learner rank %d at step %d", fault.kind, fault.rank, fault.step)
        self.trainer.learner.service.control("fault", fault.kind, fault.rank)  # the rank signals itself

    def _engine(self, fault: ChaosFault) -> None:
        assert self.trainer is not None
        engine = self.trainer.engine
        assert isinstance(engine, InProcessEngine), "checked by the config"
        log.warning("chaos: %s at step %d (during %s)", fault.kind, fault.step, fault.during.replace("_", " "))
        engine.inject(signal.SIGKILL if fault.kind == "kill_engine" else signal.SIGSTOP, during=fault.during)


class FaultyVerifiers:
    """The agent loop's verifier pool, with the faulted episodes' verifiers replaced (``Chaos.verifier``)."""

    def __init__(self, pool: VerifierPool, chaos: Chaos) -> None:
        self.pool, self.chaos = pool, chaos

    async def score(self, verify: Verify, *, traj_id: int, timeout_s: float | None = None) -> RewardOutcome:
        return await self.pool.score(self.chaos.verifier(CURRENT_EPISODE.get(None), verify), traj_id=traj_id,
                                     timeout_s=timeout_s)

    @property
    def cfg(self) -> VerifierConfig:
        return self.pool.cfg

    def failed(self, traj_id: int, detail: str) -> RewardOutcome:
        return self.pool.failed(traj_id, detail)


class StalePush:
    """The trainer's weight sync, except that the push after a ``stale_push`` fault's step loads
    nothing while the in-process engine stamps the new version as if it had: the zero-staleness
    probe must stop the run before the next batch's gradient is applied."""

    def __init__(self, weights: Any, engine: Any, chaos: Chaos) -> None:
        self.weights, self.engine, self.chaos = weights, engine, chaos

    async def connect(self) -> None:
        await self.weights.connect()

    async def push(self, version: int) -> dict[str, float]:
        if not self.chaos.stale_push(version - 1):
            return await self.weights.push(version)
        log.warning("chaos: stale_push: policy version %d is stamped, not loaded", version)
        await cast(InProcessEngine, self.engine).stamp_version(version)
        return {}


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
