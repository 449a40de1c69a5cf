"""Hang detection of the in-process engine (``InProcessEngine._watch``): an engine core with
requests in flight that reports no step for ``rollout.engine.stall_timeout_s`` is SIGKILLed (its
requests then see it die, and the restart in place of ``tests/unit/test_engine_restart.py``
follows); time inside a weight update or with nothing in flight never counts, and a dead engine is
left alone. vLLM reports each engine step to ``Progress``'s stat logger. ``inject`` (the chaos
faults) signals the core only while requests are in flight outside a weight update. The real
engine, SIGSTOPped mid-batch: ``tests/integration/test_bench_chaos.py`` (hang_engine)."""

from __future__ import annotations

import asyncio
import signal
import time
from types import SimpleNamespace

from vllm.v1.metrics.stats import IterationStats, SchedulerStats

from megathunder.rollout.engines.inprocess import InProcessEngine, Progress

STALL_S = 0.2  # the watcher ticks every STALL_S / 4


class StuckLLM:
    """An engine with ``unfinished`` requests in flight that never computes a token."""

    def __init__(self, unfinished: int) -> None:
        self.unfinished = unfinished
        self.errored = False

    def get_num_unfinished_requests(self) -> int:
        return self.unfinished


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
    drain of ``pause_generation``): nothing is sent; once requests are in flight outside the
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
