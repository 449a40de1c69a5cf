"""Reward computation in an async pool with timeouts and a defined outcome for every failure.

A verifier is an async callable returning a float reward, or a :class:`Verdict` (the reward with
the per-test outcome a test harness reports: it travels in the reward event's payload to the
run journal and the evaluation report). Wrap a blocking, CPU-bound check -- a
math grader, a test harness in Python -- with :func:`in_subprocess`, so a timeout can kill it
instead of freezing the event loop). The pool bounds how many run at once
(``verifier.max_concurrent``) and how long each may take (``verifier.timeout_s``, from when it
starts, not while it queues). A verifier that raises or times out never hangs the episode: it
produces ``verifier.on_failure`` -- ``zero_reward`` (the trajectory gets ``failure_reward``) or
``drop_group`` (its group leaves the batch) -- and a warning in the log. The agent loop applies the
same policy to an episode that failed before scoring (:meth:`VerifierPool.failed`). Timed-out verifiers are
cancelled; one that runs a sandbox command has that command's process tree killed.

Infrastructure failures are told apart from the agent's: a verifier that raises
:class:`InfrastructureError` (its test run never reached the tests, the runner was not found, the
sandbox was lost) and an episode whose sandbox could not be set up get ``verifier.on_infra_failure``
(a run's config makes it ``drop_group`` for the benchmark tasks) and ``infra=True`` in the reward
event: a broken environment is an error of the episode, never a reward of 0 that trains.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # not at run time: every in_subprocess call's process imports this module
    from megathunder.config import VerifierConfig

log = logging.getLogger(__name__)

VerifierStatus = Literal["ok", "error", "timeout", "skipped"]
"""skipped: the episode had failed before its verifier could run."""

SANDBOX_FAILURE_PREFIX = "sandbox_error: "
"""How an episode whose sandbox could not be set up reports it (``episode.SANDBOX_FAILURE``)."""


class InfrastructureError(RuntimeError):
    """The episode's environment failed, not its agent: a sandbox that could not be built or was
    lost, a test run that never reached its tests. Gets ``verifier.on_infra_failure``."""


@dataclass(frozen=True)
class Verdict:
    """A verifier's reward with what it is made of: ``tests`` maps each graded test to its
    status (``PASSED``, ``FAILED``, ...), ``detail`` says how the reward followed (JSON text)."""

    reward: float
    tests: Mapping[str, str] | None = None
    detail: str = ""


@dataclass(frozen=True)
class RewardOutcome:
    reward: float | None  # None when the group is dropped
    status: VerifierStatus
    drop_group: bool
    duration_s: float
    detail: str = ""
    tests: Mapping[str, str] | None = None  # per-test outcome, when the verifier reports one
    infra: bool = False  # the failure was the environment's (on_infra_failure), not the agent's

    def as_payload(self) -> dict:
        return {
            "reward": self.reward,
            "status": self.status,
            "drop_group": self.drop_group,
            "verifier_s": self.duration_s,
            "detail": self.detail,
            "tests": None if self.tests is None else dict(self.tests),
            "infra": self.infra,
        }


class VerifierPool:
    def __init__(self, cfg: VerifierConfig) -> None:
        self.cfg = cfg
        self._slots = asyncio.Semaphore(cfg.max_concurrent or 4)  # null outside a run's config: the rule's default
        self.num_failures = 0

    async def score(self, verify: Callable[[], Awaitable[float | Verdict]], *, traj_id: int,
                    timeout_s: float | None = None) -> RewardOutcome:
        """``timeout_s``: this verifier's limit (a task's test run's included), else
        ``verifier.timeout_s``."""
        limit = timeout_s or self.cfg.timeout_s
        async with self._slots:
            start = time.monotonic()
            try:
                got = await asyncio.wait_for(verify(), limit)
                verdict = got if isinstance(got, Verdict) else Verdict(float(got))
                reward = float(verdict.reward)
                if not math.isfinite(reward):
                    raise ValueError(f"verifier returned a non-finite reward {reward}")
            except TimeoutError as err:  # the pool's limit, or a test run the verifier saw killed
                why = str(err) or f"verifier exceeded {limit:g} s"
                return self._failed(traj_id, "timeout", why, start)
            except InfrastructureError as err:
                return self._failed(traj_id, "error", f"infrastructure: {type(err).__name__}: {err}", start,
                                    infra=True)
            except Exception as err:  # a crashing verifier is an outcome, not a crash of the loop
                return self._failed(
                    traj_id, "error", f"verifier raised {type(err).__name__}: {err}", start
                )
            return RewardOutcome(reward, "ok", False, time.monotonic() - start, verdict.detail, verdict.tests)

    def truncated(self) -> RewardOutcome:
        """The outcome of an episode cut by a length limit when ``verifier.truncated_reward`` is set:
        that reward, status ``ok``; the verifier is not run."""
        assert self.cfg.truncated_reward is not None
        return RewardOutcome(self.cfg.truncated_reward, "ok", False, 0.0, "truncated (verifier.truncated_reward)")

    def failed(self, traj_id: int, detail: str) -> RewardOutcome:
        """The outcome of an episode that failed before its verifier could run (status
        ``skipped``): the same policy as a verifier failure -- ``on_infra_failure`` when its
        sandbox could not be set up (``detail`` starts with :data:`SANDBOX_FAILURE_PREFIX`)."""
        infra = detail.startswith(SANDBOX_FAILURE_PREFIX)
        return self._failed(traj_id, "skipped", detail, time.monotonic(), infra=infra)

    def _failed(self, traj_id: int, status: VerifierStatus, detail: str, start: float, *,
                infra: bool = False) -> RewardOutcome:
        self.num_failures += 1
        drop = (self.cfg.infra_policy() if infra else self.cfg.on_failure) == "drop_group"
        log.warning(
            "trajectory %d: %s -> %s",
            traj_id,
            detail,
            "group dropped" if drop else f"reward {self.cfg.failure_reward}",
        )
        reward = None if drop else self.cfg.failure_reward
        return RewardOutcome(reward, status, drop, time.monotonic() - start, detail, infra=infra)


async def in_subprocess(fn: Callable[..., float], *args) -> float:
    """Run the blocking ``fn(*args)`` in a fresh process and return its result. Cancelled (the
    pool's timeout), the process is killed; if it dies without a result (a crash, a signal), this
    raises. Processes fork from multiprocessing's forkserver, so ``fn`` must be importable, and its
    module is imported in every call's process: keep it light, or preload it with
    ``multiprocessing.set_forkserver_preload``. The timeout includes that start-up."""
    ctx = multiprocessing.get_context("forkserver")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args), daemon=True)
    proc.start()
    send.close()
    try:
        while not recv.poll():  # a result, or end of file once the child is gone
            await asyncio.sleep(0.005)
        try:
            ok, value = recv.recv()
        except EOFError:
            proc.join()
            raise RuntimeError(f"verifier process died with exit code {proc.exitcode}") from None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        recv.close()
    if not ok:
        raise RuntimeError(value)
    return value


def _child(send, fn, args) -> None:
    try:
        send.send((True, fn(*args)))
    except BaseException as err:  # reported to the pool as the verifier's error
        send.send((False, f"{type(err).__name__}: {err}"))
