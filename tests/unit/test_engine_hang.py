"""Hang detection of the in-process engine (``InProcessEngine._watch``): an engine core with
requests in flight that reports no step for ``rollout.engine.stall_timeout_s`` is SIGKILLed (its
requests then see it die, and the restart in place of ``tests/unit/test_engine_restart.py``
follows); time inside a weight update or with nothing in flight never counts, and a dead engine is
left alone. vLLM reports each engine step to ``Progress``'s stat logger. ``inject`` (the chaos
faults) signals the core only while requests are in flight outside a weight update. Inside a
weight update each call is guarded (``_guarded``): a core that dies or hangs under it fails the
update with ``EngineUpdateError`` instead of leaving it pending forever. The real engine,
SIGSTOPped mid-batch: ``tests/integration/test_bench_chaos.py`` (hang_engine); SIGSTOPped and
SIGKILLed as a weight update begins: ``tests/integration/test_chaos.py``."""

from __future__ import annotations

import asyncio
import signal
import time
from types import SimpleNamespace

import pytest

from vllm.v1.metrics.stats import IterationStats, SchedulerStats

from megathunder.rollout.engines.inprocess import EngineUpdateError, InProcessEngine, Progress

STALL_S = 0.2  # the watcher ticks every STALL_S / 4


@pytest.fixture
def ckpt(tmp_path):
    """A checkpoint directory to load (never read: the fake engines answer no load)."""
    (tmp_path / "model.safetensors").touch()
    return str(tmp_path)


class StuckLLM:
    """An engine with ``unfinished`` requests in flight that never computes a token."""

    def __init__(self, unfinished: int) -> None:
        self.unfinished = unfinished
        self.errored = False
        # no processes to look at; an update pauses the scheduler here (as pause_generation would)
        self.engine_core = SimpleNamespace(resources=SimpleNamespace(engine_manager=None),
                                           pause_scheduler_async=self.pause_generation)

    def get_num_unfinished_requests(self) -> int:
        return self.unfinished

    async def pause_generation(self, **kwargs) -> None:  # a stopped core never answers a control call
        await asyncio.Event().wait()

    async def collective_rpc(self, *args, **kwargs) -> list:
        raise AssertionError("no call may reach an engine that died")


def watched(unfinished: int) -> tuple[InProcessEngine, StuckLLM, list[int]]:
    llm = StuckLLM(unfinished)
    engine = InProcessEngine(llm, policy_version=0)  # type: ignore[arg-type]
    signals: list[int] = []

    def signal_core(sig: int) -> list[int]:
        signals.append(sig)
        engine.llm = None  # as the dead engine is replaced: the watcher of this one ends
        return [1234]

    engine.signal_core = signal_core  # type: ignore[method-assign]
    return engine, llm, signals


def test_a_stalled_engine_core_is_killed():
    engine, llm, signals = watched(unfinished=3)

    async def main() -> float:
        progress = Progress()
        start = time.monotonic()
        await asyncio.wait_for(engine._watch(llm, progress, STALL_S), 60)  # type: ignore[arg-type]
        return time.monotonic() - start

    assert asyncio.run(main()) >= STALL_S
    assert signals == [signal.SIGKILL]


def test_a_dead_engine_is_left_alone():
    """vLLM marked it dead (its requests fail by themselves; a refused restart leaves it in place):
    the watcher ends without signalling anything."""
    engine, llm, signals = watched(unfinished=3)
    llm.errored = True

    async def main() -> None:
        await asyncio.wait_for(engine._watch(llm, Progress(), STALL_S), 60)  # type: ignore[arg-type]

    asyncio.run(main())
    assert signals == []


def test_chaos_signals_go_only_while_requests_are_in_flight_outside_an_update():
    """``inject`` on an idle engine, then inside a weight update with requests in flight (the
    drain of the update's pause): nothing is sent; once requests are in flight outside the
    update, the signal goes, once."""
    engine, llm, signals = watched(unfinished=0)

    async def main() -> None:
        engine.llm = llm  # type: ignore[assignment]
        engine.inject(signal.SIGSTOP)
        await asyncio.sleep(0.05)
        assert signals == []
        async with engine._update_lock:
            llm.unfinished = 2
            await asyncio.sleep(0.05)
            assert signals == []
        assert engine._injecting is not None
        await asyncio.wait_for(engine._injecting, 60)

    asyncio.run(main())
    assert signals == [signal.SIGSTOP]
    engine2, _, signals2 = watched(unfinished=1)
    engine2.inject(signal.SIGKILL)  # in flight now: at once
    assert signals2 == [signal.SIGKILL] and engine2._injecting is None


def test_nothing_in_flight_or_a_weight_update_never_counts_as_a_stall():
    """The watcher runs through many stall timeouts while the lock is held (a weight update) and
    then with nothing in flight; it kills only once requests are in flight outside the update, and
    only a whole stall timeout after that (the clock restarted)."""
    engine, llm, signals = watched(unfinished=2)
    progress = Progress()

    async def main() -> None:
        watcher = asyncio.ensure_future(engine._watch(llm, progress, STALL_S))  # type: ignore[arg-type]
        async with engine._update_lock:
            await asyncio.sleep(5 * STALL_S)
        assert signals == [] and not watcher.done()
        llm.unfinished = 0
        await asyncio.sleep(5 * STALL_S)
        assert signals == [] and not watcher.done()
        llm.unfinished = 1
        released = time.monotonic()
        await asyncio.wait_for(watcher, 60)
        assert time.monotonic() - released >= STALL_S * 0.75  # the clock restarted at the last tick before

    asyncio.run(main())
    assert signals == [signal.SIGKILL]


def test_progress_marks_the_steps_the_engine_reports():
    progress = Progress()
    logger = progress.stat_logger()(SimpleNamespace(), 0)
    progress.at = before = time.monotonic() - 100.0
    logger.record(None, None)  # nothing reported
    logger.record(None, IterationStats())  # outputs that computed nothing
    assert progress.at == before
    stats = IterationStats()
    stats.num_generation_tokens = 4
    logger.record(None, stats)
    assert progress.at > before + 99.0
    progress.at = before
    logger.record(SchedulerStats(), None)  # a step's scheduler snapshot (a prefill chunk: no output yet)
    assert progress.at > before + 99.0


def guarded(unfinished: int = 0) -> tuple[InProcessEngine, StuckLLM, list[int]]:
    """An engine whose control calls are timed at ``STALL_S`` (``_guarded`` polls by itself)."""
    engine, llm, signals = watched(unfinished)
    engine._stall_timeout_s = STALL_S
    return engine, llm, signals


class Transfer:
    """The engine's transfer groups: closing them must send the engine nothing once it is gone."""

    def __init__(self) -> None:
        self.abandoned = False

    async def close(self, rpc) -> None:
        raise AssertionError("an RPC to an engine that is gone")

    def abandon(self) -> None:
        self.abandoned = True


def test_a_weight_update_on_a_hung_core_fails_after_the_stall_timeout_and_close_sends_it_nothing(ckpt):
    """The core stops as the update begins: its pause never answers. After ``stall_timeout_s`` with
    no step reported the core is SIGKILLed and the update fails in one error naming the call --
    vLLM would otherwise leave the pause pending forever. A close() that was waiting for the update
    then leaves the engine alone (only what this process holds is closed)."""
    engine, llm, signals = guarded()
    engine.transfer = transfer = Transfer()  # type: ignore[assignment]
    llm.shutdown = lambda: None  # type: ignore[attr-defined]

    async def main() -> float:
        start = time.monotonic()
        update = asyncio.ensure_future(engine.update_weights(ckpt, policy_version=1))
        await asyncio.sleep(0)
        closing = asyncio.ensure_future(engine.close())  # waits for the update's lock
        with pytest.raises(EngineUpdateError, match=r"hung inside a weight update \(pause\)"):
            await asyncio.wait_for(update, 60)
        await asyncio.wait_for(closing, 60)
        return time.monotonic() - start

    assert asyncio.run(main()) >= STALL_S
    assert signals == [signal.SIGKILL] and engine.policy_version == 0 and transfer.abandoned


def test_a_core_that_dies_under_a_control_call_fails_it(ckpt):
    """Dead (vLLM marks it ``errored``) while the pause is pending: the call fails within a poll
    period, nothing is signalled, and no later call is sent to it."""
    engine, llm, signals = guarded()
    engine._stall_timeout_s = 60.0  # the death, not the clock, must fail it

    async def main() -> None:
        update = asyncio.ensure_future(engine.update_weights(ckpt, policy_version=1))
        await asyncio.sleep(0.05)
        assert not update.done()
        llm.errored = True
        with pytest.raises(EngineUpdateError, match=r"died inside a weight update \(pause\)"):
            await asyncio.wait_for(update, 60)
        with pytest.raises(EngineUpdateError, match="died"):  # a dead engine: at once, nothing sent
            await engine._guarded("inside a weight update (load)", engine._rpc(None))  # type: ignore[arg-type]

    asyncio.run(main())
    assert signals == []


def test_a_long_load_is_left_alone_while_the_engine_runs():
    """A running engine may be receiving a large model for longer than the stall timeout (a wedged
    transfer fails at the transfer groups' own timeout)."""
    engine, llm, signals = guarded()
    engine._core_stopped = lambda: False  # type: ignore[method-assign]

    async def main() -> str:
        return await engine._guarded("load", asyncio.sleep(8 * STALL_S, "loaded"), timed=False)

    assert asyncio.run(main()) == "loaded"
    assert signals == []


def test_a_load_on_a_stopped_engine_fails_after_the_stall_timeout():
    engine, llm, signals = guarded()
    engine._core_stopped = lambda: True  # type: ignore[method-assign]

    async def main() -> None:
        with pytest.raises(EngineUpdateError, match=r"hung inside a weight update \(load\)"):
            await asyncio.wait_for(engine._guarded("inside a weight update (load)", asyncio.Event().wait(),
                                                   timed=False), 60)

    asyncio.run(main())
    assert signals == [signal.SIGKILL]


def test_the_watcher_leaves_a_guarded_call_to_its_guard():
    """Requests in flight and no step, but a control call pending (a pause draining them): the
    watcher neither kills nor marks progress; the guard's own clock decides."""
    engine, llm, signals = watched(unfinished=2)

    async def main() -> None:
        watcher = asyncio.ensure_future(engine._watch(llm, engine._progress, STALL_S))  # type: ignore[arg-type]
        engine._guarding = 1
        await asyncio.sleep(6 * STALL_S)
        assert signals == [] and not watcher.done()
        watcher.cancel()

    asyncio.run(main())


def test_chaos_during_a_weight_update_fires_as_the_next_update_begins(ckpt):
    engine, llm, signals = guarded(unfinished=3)  # requests in flight: a generation fault would go now
    engine.signal_core = lambda sig: signals.append(sig) or [1234]  # type: ignore[method-assign]

    async def main() -> None:
        engine.inject(signal.SIGSTOP, during="weight_update")
        await asyncio.sleep(0.02)
        assert signals == []
        update = asyncio.ensure_future(engine.update_weights(ckpt, policy_version=1))
        await asyncio.sleep(0.02)
        assert signals == [signal.SIGSTOP] and engine._guarding == 1  # before its pause returned
        update.cancel()

    asyncio.run(main())
    assert engine._armed is None
