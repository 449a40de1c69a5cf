"""``schedule.probe_overlap``: a trailing probe's step is recorded as soon as the learner has scored
the probe -- while the next batch generates -- not between that batch's last reward and its gradient
(``Trainer._trailing_probe``); ``settle_probe`` then only collects the result. The real trainer's
order and its stale-push stop are tests/integration/test_trainer.py's; here the trainer's probe and
records are stand-ins, so the order of what happens is exact."""

from __future__ import annotations

import asyncio

import pytest

from megathunder.trainer.trainer import Trainer
from megathunder.trainer.probe import StaleWeightsError


def _trainer(scored: asyncio.Event, events: list, gap: float | Exception) -> Trainer:
    tr = object.__new__(Trainer)  # only the probe's and the records' state
    tr._probe_task, tr._unrecorded, tr.last_probe_gap = None, None, float("nan")

    async def learner_side_checked(side, unchanged):
        await scored.wait()
        events.append("probe scored")
        if isinstance(gap, Exception):
            raise gap
        return gap

    async def record():
        if tr._unrecorded is not None:
            events.append(("records of step", tr._unrecorded[0], tr.last_probe_gap))
            tr._unrecorded = None

    tr._learner_side_checked = learner_side_checked  # type: ignore[method-assign]
    tr._record = record  # type: ignore[method-assign]
    return tr


def test_a_trailing_probes_step_is_recorded_once_the_probe_is_scored_before_settle_probe():
    async def run() -> list:
        scored, events = asyncio.Event(), []
        tr = _trainer(scored, events, 2e-6)
        tr._probe_task = asyncio.create_task(tr._trailing_probe(side=None, unchanged=False))  # type: ignore[arg-type]
        tr._unrecorded = (4, None, {})  # finish_step: before it yields to the loop
        await asyncio.sleep(0)
        assert events == []  # the next batch generates; the learner has not scored the probe yet
        scored.set()
        for _ in range(5):  # the rollout's awaits: the task runs between them
            await asyncio.sleep(0)
        assert events == ["probe scored", ("records of step", 4, 2e-6)] and tr._probe_task.done()
        events.append("settle_probe")
        await tr.settle_probe()  # before the batch's gradient: nothing left to record
        assert tr._probe_task is None and tr._unrecorded is None
        return events

    assert asyncio.run(run())[-1] == "settle_probe"


def test_a_stale_trailing_probe_records_nothing_and_raises_in_settle_probe():
    async def run() -> list:
        scored, events = asyncio.Event(), []
        tr = _trainer(scored, events, StaleWeightsError("vLLM's logprobs differ"))
        tr._probe_task = asyncio.create_task(tr._trailing_probe(side=None, unchanged=False))  # type: ignore[arg-type]
        tr._unrecorded = (4, None, {})
        scored.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert events == ["probe scored"]  # the step's records are never written
        with pytest.raises(StaleWeightsError):
            await tr.settle_probe()
        return events

    assert asyncio.run(run()) == ["probe scored"]
