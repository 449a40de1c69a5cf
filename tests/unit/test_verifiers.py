"""The verifier pool: defined outcomes for crashes and timeouts, blocking verifiers in a killable
subprocess, and the concurrency bound."""

from __future__ import annotations

import asyncio
import math
import os
import time

import pytest

from megathunder.config import VerifierConfig
from megathunder.rollout.verifiers import VerifierPool, in_subprocess
from tests.verifier_fns import blocking_abort, blocking_crash, blocking_hang, blocking_reward


def _score(verify, **cfg):
    pool = VerifierPool(VerifierConfig(**{"timeout_s": 1.0, **cfg}))
    return asyncio.run(pool.score(verify, traj_id=3))


def test_blocking_verifiers_in_a_subprocess():
    # Generous timeouts where the outcome is not a timeout: the first call starts the forkserver.
    assert _score(lambda: in_subprocess(blocking_reward, 0.25), timeout_s=20).reward == 0.5
    start = time.monotonic()
    hung = _score(lambda: in_subprocess(blocking_hang, 1.0), timeout_s=0.5)
    assert hung.status == "timeout" and hung.reward == 0.0 and time.monotonic() - start < 3
    crashed = _score(
        lambda: in_subprocess(blocking_crash, 1.0), timeout_s=20, on_failure="drop_group"
    )
    assert crashed.status == "error" and crashed.drop_group
    assert "ZeroDivisionError: bad grader" in crashed.detail
    aborted = _score(lambda: in_subprocess(blocking_abort, 1.0), timeout_s=20)
    assert aborted.status == "error" and "died with exit code -6" in aborted.detail


def test_hung_subprocess_is_killed():
    import multiprocessing

    pids = []

    async def go():
        pool = VerifierPool(VerifierConfig(timeout_s=2.0))
        before = {p.pid for p in multiprocessing.active_children()}
        task = asyncio.ensure_future(
            pool.score(lambda: in_subprocess(blocking_hang, 1.0), traj_id=0)
        )
        while not pids and not task.done():  # the verifier's process, once it has started
            await asyncio.sleep(0.05)
            pids.extend(p.pid for p in multiprocessing.active_children() if p.pid not in before)
        return await task

    outcome = asyncio.run(go())
    assert outcome.status == "timeout" and pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_reward_is_an_error(bad):
    async def verify():
        return bad

    outcome = _score(verify, failure_reward=-1.0)
    assert outcome.status == "error" and outcome.reward == -1.0 and "non-finite" in outcome.detail


def test_pool_bounds_concurrency_and_timeout_excludes_queueing():
    running, peak = 0, 0

    async def verify():
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.2)
        running -= 1
        return 1.0

    async def go():
        pool = VerifierPool(VerifierConfig(timeout_s=0.3, max_concurrent=2))
        return await asyncio.gather(*(pool.score(verify, traj_id=k) for k in range(6)))

    outcomes = asyncio.run(go())
    assert peak == 2 and all(o.status == "ok" and o.reward == 1.0 for o in outcomes)


def test_infrastructure_failures_get_their_own_policy():
    """An infrastructure failure (the environment's, not the agent's) gets on_infra_failure and is
    marked infra; an ordinary verifier error keeps on_failure. A sandbox that could not be set up
    is one too. Unset, on_infra_failure follows on_failure; a benchmark task's run config makes it
    drop_group (never a 0 that trains)."""
    from megathunder.config import load_config
    from megathunder.rollout.episode import SANDBOX_FAILURE
    from megathunder.rollout.verifiers import InfrastructureError

    async def broken_env():
        raise InfrastructureError("the test runner was not found")

    async def bad_grader():
        raise ValueError("bad grader")

    cfg = {"on_failure": "zero_reward", "on_infra_failure": "drop_group"}
    infra = _score(broken_env, **cfg)
    assert infra.infra and infra.drop_group and infra.reward is None and infra.status == "error"
    assert "infrastructure: InfrastructureError: the test runner was not found" in infra.detail
    assert infra.as_payload()["infra"] is True
    plain = _score(bad_grader, **cfg)
    assert not plain.infra and not plain.drop_group and plain.reward == 0.0
    pool = VerifierPool(VerifierConfig(**cfg))
    unbuilt = pool.failed(3, f"{SANDBOX_FAILURE}image missing:1 not found")
    assert unbuilt.infra and unbuilt.drop_group and unbuilt.status == "skipped"
    assert not pool.failed(3, "nonfinite_logprob: nan at token 4").drop_group
    assert _score(broken_env).reward == 0.0 and not _score(broken_env).drop_group  # unset: on_failure
    run = load_config(None, ["task.name=terminal_bench", "task.path=/tmp"])
    assert run.verifier.on_infra_failure == "drop_group" and run.ledger.hold_groups_until_close
    assert load_config(None, []).verifier.on_infra_failure is None


def test_a_verifier_s_own_time_limit():
    """A task that runs a test suite gets its test run's wall time on top of verifier.timeout_s."""

    async def slow():
        await asyncio.sleep(0.6)
        return 1.0

    pool = VerifierPool(VerifierConfig(timeout_s=0.2))
    assert asyncio.run(pool.score(slow, traj_id=1)).status == "timeout"
    assert asyncio.run(pool.score(slow, traj_id=1, timeout_s=5.0)).reward == 1.0
