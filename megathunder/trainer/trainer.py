"""The trainer: rollout and learner wired together under one of four schedules.

    rank 0:  controller + rollout (vLLM engine, agent loop)   -- an asyncio loop
             learner calls -> LearnerClient -> LearnerService (worker thread; broadcast to the other ranks)
    others:  LearnerService.serve()  (the same learner calls, in the same order)

Per optimizer step (``megathunder.trainer.schedules``): episodes run on the engine; their events
become learner calls (``begin``, ``turn`` (OPD), ``finished``, ``reward``, ``close``); then ``step``,
the new weights are pushed into vLLM (``WeightSync.push``: every pipeline stage streams its own)
and the zero-staleness probe (``Probe``) checks that vLLM now samples from exactly the weights being
trained; the step's records (``StepRecords``) are written once the probe is checked. The walk of
one trajectory through these calls is in ``megathunder.learner.endpoint``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from megathunder.config import Config, RLObjective
from megathunder.eval.evaluate import evaluate
from megathunder.eval.instances import eval_due, eval_instances
from megathunder.learner.batches import BatchOutcome
from megathunder.learner.client import LearnerClient
from megathunder.objectives import keeps_group
from megathunder.plan.flops import Utilisation
from megathunder.rollout.agent_loop import Refill, build_agent_loop
from megathunder.rollout.chat import ChatCodec
from megathunder.rollout.engines.inprocess import InProcessEngine
from megathunder.rollout.episode import Episode, RolloutEvent, trained_reward
from megathunder.rollout.tasks.split import InstanceDrawError, step_instances
from megathunder.rollout.tasks.task import Task, TaskInstance
from megathunder.rollout.types import RolloutEngine, RoutingSource
from megathunder.trainer.probe import Probe
from megathunder.trainer.records import StepRecord, StepRecords
from megathunder.trainer.weight_sync import WeightSync
from megathunder.trajectory import BatchPlan, Trajectory

log = logging.getLogger(__name__)

Pending = asyncio.Future[None]
"""What a step leaves running into the next: its records, written once its push's probe is
checked. The next step awaits it before its own gradient is applied (a stale push raises there)."""


def done() -> Pending:
    """A step that left nothing running."""
    future: Pending = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


class Trainer:
    """The controller's parts for one run (module docstring); the schedules drive them."""

    def __init__(self, cfg: Config, out: Path, learner: LearnerClient, engine: RolloutEngine, codec: ChatCodec,
                 task: Task, start_step: int, flops: Utilisation | None = None) -> None:
        self.cfg, self.out, self.learner = cfg, out, learner
        self.engine, self.codec, self.task = engine, codec, task
        self.start_step = start_step
        self.version = start_step  # the learner's policy version == optimizer steps taken
        routing = cast(RoutingSource, engine) if cfg.rollout.engine.record_routing else None  # routing replay
        self.agent_loop = build_agent_loop(cfg, engine, codec, task, emit=self._on_event, routing=routing)
        prompt = codec.prompt_ids(task.messages(self.instances(0)[0]), task.tool_schemas())
        self.probe = Probe(engine, learner, prompt, cfg.probe, cfg.rollout.temperature,
                           cfg.rollout.engine.logprobs_mode == "processed_logprobs", routing)
        self.weights = WeightSync(engine, learner.service, cfg.rollout.engine.weight_transfer,
                                  cfg.learner.parallel.pipeline_parallel)
        self.records = StepRecords(cfg, out, learner, start_step, self.evaluate, flops=flops)
        self.last_push: dict[str, float] = {}
        self.eval_set: list[TaskInstance] | None = None
        self._streaming = False  # thunder: route the rollout's events to the learner
        # turn events reach the learner: per-turn distillation, or GRPO's per-turn score gradients
        self._turns_stream = cfg.objective.needs_teacher or cfg.ledger.per_turn_scores != "off"

    # ------------------------------------------------------------------ rollout

    def instances(self, step: int, num: int | None = None) -> list[TaskInstance]:
        """Step ``step``'s prompts (``num``, default ``batch.num_prompts_per_batch``): distinct,
        reproducible, never from the evaluation split; a longer draw extends a shorter one."""
        return step_instances(self.cfg, self.task, step, num)

    async def rollout(self, step: int, stream: bool = False) -> list[Episode]:
        """One batch of episodes (group g = instance g), dropped groups replaced when
        ``batch.max_refill_groups`` says so; ``stream`` routes events to the learner."""
        self._streaming = stream
        try:
            return await self.agent_loop.run_batch(self.instances(step), self.cfg.batch.samples_per_prompt,
                                                   seed=self.cfg.run.seed * 7919 + step, refill=self._refill(step))
        finally:
            self._streaming = False
            self.learner.flush()

    def _refill(self, step: int) -> Refill | None:
        """DAPO's refill: group N + j on the step's (N + j)-th prompt, announced to a streaming learner."""
        budget, n = self.cfg.batch.max_refill_groups, self.cfg.batch.num_prompts_per_batch
        if budget == 0:
            return None

        def announce(group_id: int, traj_ids: list[int]) -> None:
            if self._streaming:
                self.learner.add_group(group_id, traj_ids)

        def instance(j: int) -> TaskInstance | None:
            try:
                return self.instances(step, n + j + 1)[-1]
            except InstanceDrawError as err:
                log.warning("step %d: no prompt left to replace a dropped group (%s)", step, err)
                return None

        return Refill(budget, instance, self.group_dropped, announce)

    def group_dropped(self, members: Sequence[Episode]) -> bool:
        """The learner will drop this finished group: a failed trajectory, or all rewards equal under DAPO."""
        rewards = [e.trained_reward for e in members]
        objective = self.cfg.objective
        if any(r is None for r in rewards):
            return True
        return isinstance(objective, RLObjective) and not keeps_group([r for r in rewards if r is not None], objective)

    def _on_event(self, event: RolloutEvent) -> None:
        if not self._streaming:
            return
        if event.kind == "turn_finished" and self._turns_stream:  # its tool call starts now
            p = event.payload
            self.learner.turn(event.traj_id, p["token_ids"], p["start"], p["end"], p["logprobs"])
        elif event.kind == "trajectory_finished":
            self.learner.finished(event.payload["episode"].to_trajectory())
        elif event.kind == "reward":
            self.learner.reward(event.traj_id, trained_reward(event.payload))

    def plan(self) -> BatchPlan:
        """The plan of a batch ``rollout`` makes: group g holds trajectories g * s .. g * s + s - 1."""
        s = self.cfg.batch.samples_per_prompt
        return [(g, [g * s + k for k in range(s)]) for g in range(self.cfg.batch.num_prompts_per_batch)]

    # ------------------------------------------------------------------ learner side of a step

    async def train_at_end(self, episodes: list[Episode]) -> BatchOutcome:
        """The batch-synchronous path: every event of the batch, then the gradient."""
        plan, trajs, rewards = as_batch(episodes)
        self.learner.begin(plan, False)
        for _, traj in sorted(zip(episodes, trajs), key=lambda p: p[0].finished_at):
            self.learner.finished(traj)
        for tid, reward in rewards:
            self.learner.reward(tid, reward)
        return await self.learner.close()  # sends the events first

    async def finish(self, step: int, rec: StepRecord, outcome: BatchOutcome, push: bool = True) -> Pending:
        """After the batch's gradient: the optimizer step; the push and its probe (``push``: not
        under async, which pushes at the next step's start); then the step's records -- at once, or,
        when the probe's learner part trails into the next batch (``may_trail``), as soon as it is
        scored. Returns them, pending or done: the next step awaits them before its gradient."""
        result = await self.learner.step()
        self.version += 1
        trail = push and self.may_trail(step)
        check = await self.push_weights(trail=trail) if push else None
        row = self.records.row(step, rec, outcome, result, self.version, self._columns())
        if trail:
            self.learner.service.step_index = step + 1  # the trailing probe's learner call belongs to the next step
        records = asyncio.ensure_future(self._record(step, rec, row, check))
        if not trail:
            await records
        return records

    async def _record(self, step: int, rec: StepRecord, row: dict, check: asyncio.Task[float] | None) -> None:
        if check is not None:
            await check  # a stale push raises: its step's records are never written
        await self.records.write(step, rec, row, self.probe.columns())

    def may_trail(self, step: int) -> bool:
        """``probe.overlap``: sync and thunder, once the probe is calibrated, never at the run's last
        step nor when an evaluation, a checkpoint or an after-step hook (a chaos fault) follows the
        step's records."""
        cfg = self.cfg
        return (cfg.probe.overlap and cfg.schedule.on_policy and self.probe.enabled and self.probe.calibrated
                and step + 1 < cfg.run.num_steps and not eval_due(cfg, step + 1)
                and not self.records.checkpoint_due(step) and not self.records.acts_after(step))

    async def evaluate(self, step: int, force: bool = False) -> dict:
        """pass@1..k on the held-out instances with the weights just pushed (``eval.every_n_steps``).
        Training episodes still running (async, fully_async: the next batch) start no turn while it
        runs (``AgentLoop.pause``), so its seconds (``eval/wall_s``) are no schedule's training time."""
        last = self.cfg.eval.every_n_steps and step + 1 == self.cfg.run.num_steps
        if not (force or eval_due(self.cfg, step + 1) or last):
            return {}
        if self.eval_set is None:
            self.eval_set = eval_instances(self.cfg, self.task)
        async with self.agent_loop.pause:
            result = await evaluate(self.cfg, self.engine, self.codec, self.task, self.eval_set)
        try:
            return result.metrics()
        except Exception as err:  # missing samples: recorded, never a score over fewer instances
            log.warning("step %d: evaluation incomplete: %s", step, err)
            return {"eval/incomplete": 1}

    def _columns(self) -> dict:
        """Other components' columns of a step's row: the last push's figures, engine restarts."""
        restarts = {"engine_restarts": self.engine.num_restarts} if isinstance(self.engine, InProcessEngine) else {}
        return {**self.last_push, **restarts}

    # ------------------------------------------------------------------ weights

    async def push_weights(self, trail: bool = False) -> asyncio.Task[float] | None:
        """New weights into vLLM (``WeightSync.push``: each learner stage streams its own buckets into
        the engine's transfer groups while the engine is paused; ``weight_transfer.kind=rpc``: rank
        0 gathers them first), then the probe: whole, or (``trail``) vLLM's part now and the
        learner's as the returned task (None: checked already)."""
        start = time.monotonic()
        stats = await self.weights.push(self.version)
        self.last_push = {"push_s": time.monotonic() - start, "push_bytes": stats.get("payload_bytes", float("nan")),
                          "push_changed_fraction": stats.get("changed_fraction", float("nan"))}
        probe_start = time.monotonic()
        unchanged = stats.get("changed_fraction") == 0.0  # no weight moved in the inference dtype
        check = None
        if trail:
            check = await self.probe.start(self.version, unchanged)
        else:
            await self.probe.check(self.version, unchanged)
        self.last_push["probe_s"] = time.monotonic() - probe_start  # what the step waited for
        self.last_push["probe_trailed"] = int(trail)
        self.records.timeline.add_sync(start, time.monotonic(), self.version)
        return check

    async def revive_engine(self) -> None:
        """A restarted in-process engine (its engine core died mid-batch; the engine's ``revive``
        hook, ``trainer/run.py``): the learner's weights into it, then the probe's gap. Under sync
        and thunder the learner steps only after the batch's rollout, so these are the weights the
        dead engine sampled from (the requests it cut off, sent again with their seeds, give the
        same tokens); under async schedules the learner may already be ahead of the batch's
        policy, so there is no restart there."""
        if not self.cfg.schedule.on_policy:
            raise RuntimeError(f"schedule.mode={self.cfg.schedule.mode}: the learner's weights may be ahead of the "
                               "policy the batch is sampled from")
        await self.weights.push(self.version)  # new groups first, so a dense push (the senders' baseline is reset)
        gap = await self.probe.check_revived(self.version)
        log.warning("restarted engine checked: probe gap %.2e at policy version %d", gap, self.version)

    def close(self) -> None:
        self.records.close()


def as_batch(episodes: list[Episode]) -> tuple[BatchPlan, list[Trajectory], list[tuple[int, float | None]]]:
    """Renumber episodes (grouped, in sample order) into a batch plan, trajectories and rewards."""
    by_group: dict[int, list[Episode]] = {}
    for ep in episodes:
        by_group.setdefault(ep.group_id, []).append(ep)
    plan: BatchPlan = []
    trajs: list[Trajectory] = []
    rewards: list[tuple[int, float | None]] = []
    tid = 0
    for g, members in enumerate(by_group.values()):
        ids = []
        for ep in sorted(members, key=lambda e: e.traj_id):
            traj = ep.to_trajectory()
            traj.traj_id, traj.group_id = tid, g
            trajs.append(traj)
            rewards.append((tid, ep.trained_reward))
            ids.append(tid)
            tid += 1
        plan.append((g, ids))
    return plan, trajs, rewards
