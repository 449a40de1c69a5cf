"""The four schedules, one coroutine each, on the same trainer and components.

    sync         rollout(k) ........ | learner(k) | push |
    thunder      rollout(k) + learner(k) streaming  | close, step, push |   (same update as sync)

    (sync and thunder: the learner scores push k's probe while batch k + 1 generates, and step
     k + 1 awaits it before its gradient is applied: ``probe.overlap``)
    async        rollout(k+1) || learner(k)         | push |               (data one step stale)
    fully_async  episodes run continuously; learner takes the next complete groups; push under them

sync and thunder train on data from the current weights (policy lag 0); the probe after each push
checks that. async's batch k was sampled by the weights before step k-1's update (lag 1), and
fully_async's groups are at most ``schedule.max_staleness`` steps old (older groups are dropped);
both rely on ``objective.tis`` for the importance correction.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Protocol

from megathunder.rollout.episode import Episode
from megathunder.trainer.records import StepRecord
from megathunder.trainer.trainer import Pending, Trainer, done

log = logging.getLogger(__name__)


class Steps(Protocol):
    """The optimizer steps to run: ``range(start, stop)``, or one that may end early (a signal)."""

    start: int
    stop: int

    def __iter__(self) -> Iterator[int]: ...

    def __len__(self) -> int: ...


Step = Callable[[Trainer, int, Pending], Awaitable[Pending]]
"""One step of an on-policy schedule: given what the step before left running (``Pending``: its
records, behind its push's trailing probe), returns what this one leaves."""


async def run_sync(tr: Trainer, steps: Steps) -> None:
    await run_steps(tr, steps, sync_step)


async def run_thunder(tr: Trainer, steps: Steps) -> None:
    await run_steps(tr, steps, thunder_step)


async def run_steps(tr: Trainer, steps: Steps, step_fn: Step) -> None:
    """Each step hands the next what it left running; the last is awaited (or cancelled on an error)."""
    last = done()
    try:
        for step in steps:
            last = await step_fn(tr, step, last)
        await last
    finally:
        last.cancel()


async def sync_step(tr: Trainer, step: int, last: Pending, label: str | None = None) -> Pending:
    """One step of sync: the whole batch, then its gradient (``label``: the path's name in the
    metrics row when the run's schedule is another's)."""
    started = time.monotonic()
    episodes = await tr.rollout(step)
    await last  # the last push's probe, scored while this batch generated
    outcome = await tr.train_at_end(episodes)
    return await tr.finish(step, StepRecord(episodes, started, schedule=label), outcome)


async def thunder_step(tr: Trainer, step: int, last: Pending) -> Pending:
    """One step of thunder: the batch's events reach the learner as they happen."""
    started = time.monotonic()
    tr.learner.begin(tr.plan(), streamed=True)
    episodes = await tr.rollout(step, stream=True)
    await last  # checked before this batch's gradient is closed and applied
    outcome = await tr.learner.close()
    return await tr.finish(step, StepRecord(episodes, started), outcome)


async def run_async(tr: Trainer, steps: Steps) -> None:
    pending = asyncio.create_task(tr.rollout(steps.start))
    for step in steps:
        started = time.monotonic()
        episodes = await pending  # sampled one version behind the learner (except the first)
        if step > steps.start:
            await tr.push_weights()  # no request in flight: the next batch is one version old
        if step + 1 < steps.stop:
            pending = asyncio.create_task(tr.rollout(step + 1))  # overlaps the learner's work below
        outcome = await tr.train_at_end(episodes)
        await tr.finish(step, StepRecord(episodes, started), outcome, push=False)
    await tr.push_weights()


async def run_fully_async(tr: Trainer, steps: Steps) -> None:
    cfg = tr.cfg
    num_groups, size = cfg.batch.num_prompts_per_batch, cfg.batch.samples_per_prompt
    finished: asyncio.Queue[list[Episode]] = asyncio.Queue()
    slots = asyncio.Semaphore(2 * num_groups)  # groups in flight: one batch ahead of the learner
    counter = itertools.count()

    async def run_group(g: int) -> None:
        try:
            step_seed, index = divmod(g, num_groups)
            inst = tr.instances(steps.start + step_seed)[index]
            eps = await asyncio.gather(*(
                tr.agent_loop.run_episode(inst, traj_id=g * size + k, group_id=g, seed=cfg.run.seed * 7919 + g * size + k)
                for k in range(size)
            ))  # fmt: skip
            await finished.put(list(eps))
        finally:
            slots.release()

    tasks: set[asyncio.Task] = set()

    async def produce() -> None:
        while True:
            await slots.acquire()
            task = asyncio.create_task(run_group(next(counter)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    producer = asyncio.create_task(produce())
    try:
        for step in steps:
            started = time.monotonic()
            batch: list[list[Episode]] = []
            stale = refilled = 0  # refilled: dropped groups taken beyond num_groups (batch.max_refill_groups)
            while len(batch) - refilled < num_groups:
                group = await finished.get()
                oldest = min((t.policy_version for e in group for t in e.turns), default=tr.version)
                if tr.version - oldest > cfg.schedule.max_staleness:
                    stale += 1
                    log.info("step %d: dropped a group sampled at version %d (> %d behind)", step, oldest,
                             cfg.schedule.max_staleness)
                    continue
                batch.append(group)
                if refilled < cfg.batch.max_refill_groups and tr.group_dropped(group):
                    refilled += 1  # the learner drops it: the next finished group takes its place
            episodes = [e for group in batch for e in group]
            outcome = await tr.train_at_end(episodes)
            await tr.finish(step, StepRecord(episodes, started, dropped_stale=stale), outcome)
    finally:
        producer.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(producer, *tasks, return_exceptions=True)


Schedule = Callable[[Trainer, Steps], Awaitable[None]]

SCHEDULES: dict[str, Schedule] = {
    "sync": run_sync, "thunder": run_thunder, "async": run_async, "fully_async": run_fully_async,
}
