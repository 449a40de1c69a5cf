"""``probe.overlap``: a trailing probe's step is recorded as soon as the learner has scored the probe
-- while the next batch generates -- not between that batch's last reward and its gradient
(``Trainer.finish`` returns the records as a pending task; the next step awaits it before its
gradient). The real trainer's order and its stale-push stop are tests/integration/test_trainer.py's;
here the probe and the records are stand-ins, so the order of what happens is exact."""

from __future__ import annotations

import asyncio

import pytest

from megathunder.trainer.probe import StaleWeightsError
from megathunder.trainer.schedules import run_steps
from megathunder.trainer.trainer import Trainer


class Records:
    def __init__(self, events: list) -> None:
        self.events = events

    async def write(self, step, rec, row, columns) -> None:
        self.events.append(("records of step", step, columns["probe_gap"]))


class Probe:
    def __init__(self) -> None:
        self.gap = float("nan")

    def columns(self) -> dict:
        return {"probe_gap": self.gap}


def _trainer(events: list) -> Trainer:
    tr = object.__new__(Trainer)  # only what ``_record`` reads
    tr.records, tr.probe = Records(events), Probe()  # type: ignore[assignment]
    return tr


def _check(tr: Trainer, scored: asyncio.Event, events: list, gap: float | Exception) -> asyncio.Task:
    async def learner_part() -> float:
        await scored.wait()
        events.append("probe scored")
        if isinstance(gap, Exception):
            raise gap
        tr.probe.gap = gap  # type: ignore[attr-defined]
        return gap

    return asyncio.create_task(learner_part())


def test_a_trailing_probes_step_is_recorded_once_the_probe_is_scored_before_the_next_gradient():
    async def run() -> list:
        scored, events = asyncio.Event(), []
        tr = _trainer(events)
        pending = asyncio.ensure_future(tr._record(4, None, {}, _check(tr, scored, events, 2e-6)))
        await asyncio.sleep(0)
        assert events == []  # the next batch generates; the learner has not scored the probe yet
        scored.set()
        for _ in range(5):  # the rollout's awaits: the task runs between them
            await asyncio.sleep(0)
        assert events == ["probe scored", ("records of step", 4, 2e-6)] and pending.done()
        events.append("the next step awaits it")
        await pending  # before the batch's gradient: nothing left to record
        return events

    assert asyncio.run(run())[-1] == "the next step awaits it"


def test_a_stale_trailing_probe_records_nothing_and_raises_where_the_next_step_awaits_it():
    async def run() -> list:
        scored, events = asyncio.Event(), []
        tr = _trainer(events)
        pending = asyncio.ensure_future(tr._record(4, None, {}, _check(tr, scored, events, StaleWeightsError("x"))))
        scored.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert events == ["probe scored"]  # the step's records are never written
        with pytest.raises(StaleWeightsError):
            await pending
        return events

    assert asyncio.run(run()) == ["probe scored"]


def test_the_step_loop_hands_each_step_what_the_last_left_and_cancels_it_on_an_error():
    """``run_steps``: step k + 1 receives step k's pending records and the last is awaited before
    the loop ends; a step that raises leaves the one before it cancelled, not writing into a run
    that is closing."""

    async def run(num_steps: int, failing_step: int | None) -> tuple[list, list]:
        handed, left = [], []

        async def step_fn(tr, step, last):
            handed.append(last)
            if step == failing_step:
                raise RuntimeError(f"step {step} failed")
            pending = asyncio.ensure_future(asyncio.sleep(0.01))
            left.append(pending)
            return pending

        try:
            await run_steps(None, range(num_steps), step_fn)  # type: ignore[arg-type]
        except RuntimeError:
            pass
        return handed, left

    handed, left = asyncio.run(run(3, None))
    assert handed[1:] == left[:-1] and handed[0].done()  # each step gets the last one's; the first, a done one
    assert all(p.done() and not p.cancelled() for p in left)  # the last was awaited
    handed, left = asyncio.run(run(3, 1))
    assert len(left) == 1 and left[0].cancelled()
