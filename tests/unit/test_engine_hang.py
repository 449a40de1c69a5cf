"""Hang detection of the in-process engine (``InProcessEngine._watch``): an engine core with
requests in flight that computes no token for ``rollout.engine.stall_timeout_s`` is SIGKILLed (its
requests then see it die, and the restart in place of ``tests/unit/test_engine_restart.py``
follows); time inside a weight update or with nothing in flight never counts. vLLM reports each
engine step's tokens to ``Progress``'s stat logger. The real engine, SIGSTOPped mid-batch:
``tests/integration/test_bench_chaos.py`` (hang_engine)."""

from __future__ import annotations

import asyncio
import signal
import time
from types import SimpleNamespace

from vllm.v1.metrics.stats import IterationStats

from megathunder.rollout.engines.inprocess import InProcessEngine, Progress

STALL_S = 0.2  # the watcher ticks every STALL_S / 4


class StuckLLM:
    """An engine with ``unfinished`` requests in flight that never computes a token."""

    def __init__(self, unfinished: int) -> None:
        self.unfinished = unfinished

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
    progress = Progress()

    async def main() -> float:
        start = time.monotonic()
        await asyncio.wait_for(engine._watch(llm, progress, STALL_S), 60)  # type: ignore[arg-type]
        return time.monotonic() - start

    assert asyncio.run(main()) >= STALL_S
    assert signals == [signal.SIGKILL]


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


def test_progress_marks_only_steps_that_computed_tokens():
    progress = Progress()
    logger = progress.stat_logger()(SimpleNamespace(), 0)
    progress.at = before = time.monotonic() - 100.0
    logger.record(None, None)  # stats without outputs
    logger.record(None, IterationStats())  # a step that computed nothing
    assert progress.at == before
    stats = IterationStats()
    stats.num_generation_tokens = 4
    logger.record(None, stats)
    assert progress.at > before + 99.0
