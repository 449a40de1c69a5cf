"""The trainer: rollout and learner wired together under one of four schedules.

    rank 0:  controller + rollout (vLLM engine, agent loop)   -- an asyncio loop
             learner calls -> LearnerService (worker thread; broadcast to the other ranks)
    others:  LearnerService.serve()  (the same learner calls, in the same order)

Per optimizer step: episodes run on the engine; their events become ``LearnerEndpoint`` calls
(``begin``, ``turn`` (OPD), ``finished``, ``reward``, ``close``); then ``step``, the new weights
are pushed into vLLM (``WeightSync.push``: every pipeline stage streams its own), and the
zero-staleness probe checks that vLLM now samples from exactly the weights being trained.
Everything is journaled.
The walk of one trajectory through these calls is in ``megathunder.learner.endpoint``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast
from pathlib import Path

import torch
from tqdm import tqdm

from megathunder.config import Config, RLObjective
from megathunder.eval.evaluate import evaluate
from megathunder.eval.instances import eval_due, eval_instances
from megathunder.learner.batches import BatchOutcome
from megathunder.learner.endpoint import LearnerEndpoint
from megathunder.learner.learner import StepResult
from megathunder.learner.service import LearnerService
from megathunder.objectives import keeps_group
from megathunder.rollout.agent_loop import Refill, build_agent_loop
from megathunder.rollout.chat import ChatCodec
from megathunder.rollout.engines.inprocess import InProcessEngine
from megathunder.rollout.episode import Episode, RolloutEvent, trained_reward
from megathunder.rollout.tasks.split import InstanceDrawError, step_instances
from megathunder.rollout.tasks.task import Task, TaskInstance
from megathunder.rollout.types import Completion, RolloutEngine, RoutingSource, SamplingParams
from megathunder.trainer.journal import Journal
from megathunder.trainer.metrics import MetricsLog
from megathunder.trainer.chaos import Chaos
from megathunder.trainer.probe import (
    PROBE_SESSION,
    PROBE_SEED,
    ProbeSample,
    ProbeTolerance,
    StaleWeightsError,
    engine_kept_its_weights,
    engine_probe,
    max_logprob_gap,
)
from megathunder.trainer.timeline import Timeline
from megathunder.trainer.weight_sync import WeightSync
from megathunder.trajectory import BatchPlan, Trajectory

log = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """What one optimizer step trained on and how long things took (for metrics and timeline)."""

    episodes: list[Episode]
    started: float  # time.monotonic() when the step's wait for data began
    dropped_stale: int = 0
    schedule: str | None = None  # the path the step took, when not schedule.mode's (``paired_sync``)


@dataclass(frozen=True)
class _EngineSide:
    """vLLM's part of one probe: the tokens after the prompt, their logprobs, the routed experts."""

    version: int
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    routed: torch.Tensor | None


class Trainer:
    def __init__(self, cfg: Config, out: Path, service: LearnerService[LearnerEndpoint], engine: RolloutEngine,
                 codec: ChatCodec, task: Task, start_step: int) -> None:
        self.cfg, self.out, self.service = cfg, out, service
        self.engine, self.codec, self.task = engine, codec, task
        routing = cast(RoutingSource, engine) if cfg.rollout.engine.record_routing else None  # routing replay
        self.agent_loop = build_agent_loop(cfg, engine, codec, task, emit=self._on_event, routing=routing)
        self.start_step = start_step
        self.version = start_step  # the learner's policy version == optimizer steps taken
        self.journal = Journal(out / "journal.jsonl", keep_steps=start_step)
        self.metrics = MetricsLog(out, cfg, keep_steps=start_step)
        self.timeline = Timeline()
        self.chaos = Chaos(cfg.chaos.faults, out, engine, cfg.sandbox, cfg.verifier, service)  # none unless configured
        self.weights = WeightSync(engine, service, cfg.rollout.engine.weight_transfer,
                                  cfg.learner.parallel.pipeline_parallel)
        if self.chaos.has_episode_faults:
            self.agent_loop.faults = self.chaos
        self._finished_in_step: dict[int, int] = {}
        self.t0 = time.monotonic()
        self.wall_offset = self.metrics.rows[-1]["wall_s"] if self.metrics.rows else 0.0
        self.last_probe_gap = float("nan")
        self.last_probe_gap_own_routing = float("nan")  # routing replay: the probe's gap without it
        self.last_push: dict[str, float] = {}
        sched = cfg.schedule
        self.probe_tolerance = ProbeTolerance(sched.probe_tolerance, sched.probe_noise_margin)
        self._last_probe: ProbeSample | None = None
        self._probe_continuation: list[int] | None = None  # the tokens every push's probe scores
        self._probe_task: asyncio.Task[None] | None = None  # a trailing probe's learner part, then the records
        self._unrecorded: tuple[int, StepRecord, dict] | None = None  # a step whose probe trails
        self.eval_set: list[TaskInstance] | None = None
        self.bar: tqdm | None = None
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
        self.chaos.rollout_step = step  # chaos.faults of this step's episodes
        try:
            return await self.agent_loop.run_batch(self.instances(step), self.cfg.batch.samples_per_prompt,
                                                   seed=self.cfg.run.seed * 7919 + step, refill=self._refill(step))
        finally:
            self._streaming = False
            self.service.flush_events()

    def _refill(self, step: int) -> Refill | None:
        """DAPO's refill: group N + j on the step's (N + j)-th prompt, announced to a streaming learner."""
        budget, n = self.cfg.batch.max_refill_groups, self.cfg.batch.num_prompts_per_batch
        if budget == 0:
            return None

        def announce(group_id: int, traj_ids: list[int]) -> None:
            if self._streaming:
                self._stream(LearnerEndpoint.add_group, group_id, traj_ids)

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
        if event.kind == "trajectory_finished" and self.chaos.pending:
            self.service.flush_events()  # a learner fault fires after the events before it, as they happened
            self._finished_in_step[self.version] = self._finished_in_step.get(self.version, 0) + 1
            self.chaos.trajectory_finished(self.version, self._finished_in_step[self.version])
        if not self._streaming:
            return
        if event.kind == "turn_finished" and self._turns_stream:  # its tool call starts now
            p = event.payload
            self._stream(LearnerEndpoint.turn, event.traj_id, p["token_ids"], p["start"], p["end"], p["logprobs"])
        elif event.kind == "trajectory_finished":
            self._stream(LearnerEndpoint.finished, event.payload["episode"].to_trajectory())
        elif event.kind == "reward":
            self._stream(LearnerEndpoint.reward, event.traj_id, trained_reward(event.payload))

    def _stream(self, method, *args) -> None:
        """An event call for the learner, sent with the other events of this turn of the event loop
        in one message (``LearnerService.submit_event``): a burst of sequences finishing in one
        engine step wakes the learner once, not once per event, while the engine still generates."""
        if self.service.submit_event(method, *args):
            asyncio.get_running_loop().call_soon(self.service.flush_events)

    def plan(self) -> BatchPlan:
        """The plan of a batch ``rollout`` makes: group g holds trajectories g * s .. g * s + s - 1."""
        s = self.cfg.batch.samples_per_prompt
        return [(g, [g * s + k for k in range(s)]) for g in range(self.cfg.batch.num_prompts_per_batch)]

    # ------------------------------------------------------------------ learner side of a step

    async def train_at_end(self, episodes: list[Episode]) -> BatchOutcome:
        """The batch-synchronous path: every event of the batch, then the gradient."""
        plan, trajs, rewards = as_batch(episodes)
        self.service.submit(LearnerEndpoint.begin, plan, False)
        for _, traj in sorted(zip(episodes, trajs), key=lambda p: p[0].finished_at):
            self.service.submit_event(LearnerEndpoint.finished, traj)
        for tid, reward in rewards:
            self.service.submit_event(LearnerEndpoint.reward, tid, reward)
        return await self.service.call(LearnerEndpoint.close)  # sends the events first

    async def finish_step(self, step: int, rec: StepRecord, outcome: BatchOutcome, push: bool = True) -> None:
        """After the batch's gradient: the optimizer step, the weight push and probe, then the
        step's records (metrics, journal, timeline), evaluation and checkpoint when due. With
        ``schedule.probe_overlap`` the learner's part of the probe (and the records after it) may
        trail into the next batch: ``settle_probe`` finishes them."""
        result = await self.service.call(LearnerEndpoint.step)
        self.version += 1
        trail = push and self._probe_may_trail(step)
        if push:
            await self.push_weights(trail_probe=trail)
        self._unrecorded = (step, rec, self._row(step, rec, outcome, result))
        if trail:
            self.service.step_index = step + 1  # the trailing probe's learner call belongs to the next step
        else:
            await self.settle_probe()

    async def settle_probe(self) -> None:
        """The last push's probe, if its learner part trailed into this batch (a stale push raises
        here: the schedules call this before the batch's gradient is closed), then the records of the
        step it followed -- usually written already, while this batch generated (``_trailing_probe``).
        Nothing to do when the probe ran whole."""
        if self._probe_task is not None:
            task, self._probe_task = self._probe_task, None
            await task
        await self._record()

    async def _trailing_probe(self, side: _EngineSide, unchanged: bool) -> None:
        """A trailing probe's learner part, then the records of the step it followed, as soon as it
        is scored: they are written on the event loop while the next batch generates, not between
        its last reward and its gradient. Nothing else follows such a step (``_probe_may_trail``: no
        evaluation, checkpoint or chaos fault). ``finish_step`` sets ``_unrecorded`` before it yields
        to the loop, so before this task first runs."""
        self.last_probe_gap = await self._learner_side_checked(side, unchanged)
        await self._record()

    async def _record(self) -> None:
        """The records of the step in ``_unrecorded``: metrics, journal, timeline, evaluation and
        checkpoint when due, the progress bar."""
        if self._unrecorded is None:
            return
        (step, rec, row), self._unrecorded = self._unrecorded, None
        row.update(self._probe_columns())
        row.update(await self.periodic_eval(step))
        self._journal(step, rec, row)
        self.metrics.log(row)
        self.chaos.after_step(step)  # chaos.faults: a full disk meets the checkpoint below
        self.timeline.add_episodes(step, rec.episodes)
        self._keep_timeline_from(step + 1 - self.cfg.run.timeline_steps)
        if self._checkpoint_due(step):
            await self.service.call(LearnerEndpoint.checkpoint)
        self.service.step_index = max(self.service.step_index, step + 1)
        self._show_progress(row)

    def abandon_probe(self) -> None:
        """The run is ending on an error: a trailing probe's task is cancelled, its step unrecorded."""
        if self._probe_task is not None:
            self._probe_task.cancel()
            self._probe_task = None
        self._unrecorded = None

    def _probe_may_trail(self, step: int) -> bool:
        """``schedule.probe_overlap``: sync and thunder, once the probe is calibrated, never at the
        run's last step nor when an evaluation, a checkpoint or a chaos fault follows the step's records."""
        sched = self.cfg.schedule
        return (sched.probe_overlap and sched.mode in ("sync", "thunder") and sched.probe_tokens > 0
                and self.probe_tolerance.floor is not None and step + 1 < self.cfg.run.num_steps
                and not eval_due(self.cfg, step + 1) and not self._checkpoint_due(step)
                and not self.chaos.fires_after(step))

    async def periodic_eval(self, step: int, force: bool = False) -> dict:
        """pass@1..k on the held-out instances with the weights just pushed (``eval.every_n_steps``)."""
        last = self.cfg.eval.every_n_steps and step + 1 == self.cfg.run.num_steps
        if not (force or eval_due(self.cfg, step + 1) or last):
            return {}
        if self.eval_set is None:
            self.eval_set = eval_instances(self.cfg, self.task)
        result = await evaluate(self.cfg, self.engine, self.codec, self.task, self.eval_set)
        try:
            return result.metrics()
        except Exception as err:  # missing samples: recorded, never a score over fewer instances
            log.warning("step %d: evaluation incomplete: %s", step, err)
            return {"eval/incomplete": 1}

    # ------------------------------------------------------------------ weights

    async def push_weights(self, trail_probe: bool = False) -> None:
        """New weights into vLLM, then the probe. By default each learner stage streams its own
        buckets into the engine's transfer groups while the engine is paused (``WeightSync.push``);
        with ``weight_transfer.kind=rpc`` rank 0 gathers them first. ``trail_probe``: vLLM's part of
        the probe runs now, the learner's is queued behind it and checked by ``settle_probe``."""
        start = time.monotonic()
        if self.chaos.stale_push(self.version - 1):  # chaos.faults: the transfer fails silently
            log.warning("chaos: stale_push: policy version %d is stamped, not loaded", self.version)
            await cast(InProcessEngine, self.engine).stamp_version(self.version)
            stats: dict[str, float] = {}
        else:
            stats = await self.weights.push(self.version)
        self.last_push = {"push_s": time.monotonic() - start, "push_bytes": stats.get("payload_bytes", float("nan")),
                          "push_changed_fraction": stats.get("changed_fraction", float("nan"))}
        probe_start = time.monotonic()
        if trail_probe:
            side = await self._engine_side()
            self._probe_task = asyncio.create_task(self._trailing_probe(side, self._push_unchanged()))
            self.last_probe_gap = float("nan")
        else:
            self.last_probe_gap = await self.probe()
        self.last_push["probe_s"] = time.monotonic() - probe_start  # what the step waited for
        self.last_push["probe_trailed"] = int(trail_probe)
        self.timeline.add_sync(start, time.monotonic(), self.version)

    async def revive_engine(self) -> None:
        """A restarted in-process engine (its engine core died mid-batch; the engine's ``revive``
        hook, ``trainer/run.py``): the learner's weights into it, then the probe's gap. Under sync
        and thunder the learner steps only after the batch's rollout, so these are the weights the
        dead engine sampled from (the requests it cut off, sent again with their seeds, give the
        same tokens); under async schedules the learner may already be ahead of the batch's
        policy, so there is no restart there."""
        if self.cfg.schedule.mode not in ("sync", "thunder"):
            raise RuntimeError(f"schedule.mode={self.cfg.schedule.mode}: the learner's weights may be ahead of the "
                               "policy the batch is sampled from")
        await self.weights.push(self.version)  # new groups first, so a dense push (the senders' baseline is reset)
        sample = await self._probe_sample()
        gap = self._gap(sample)
        if gap > self.probe_tolerance.value:
            raise StaleWeightsError(f"the restarted engine's logprobs differ from the learner's by {gap:.3e} (> "
                                    f"{self.probe_tolerance.value:.3e}): it is not sampling from the weights being trained")
        log.warning("restarted engine checked: probe gap %.2e at policy version %d", gap, self.version)

    async def probe(self) -> float:
        """Check that vLLM samples from the weights just pushed (``megathunder.trainer.probe``):
        calibrate the noise floor the first time, when both sides hold the same weights; afterwards
        vLLM must have moved with the learner and agree with it up to the numerics. Returns the
        push's gap."""
        if self.cfg.schedule.probe_tokens == 0:
            return float("nan")
        if self.probe_tolerance.floor is None:
            await self._calibrate_probe()
        return await self._learner_side_checked(await self._engine_side(), self._push_unchanged())

    def _push_unchanged(self) -> bool:
        """No weight moved in the inference dtype at the last push (vLLM may then repeat its probe)."""
        return self.last_push.get("push_changed_fraction") == 0.0

    async def _learner_side_checked(self, side: _EngineSide, unchanged: bool) -> float:
        """The learner's logprobs of vLLM's probe, then both checks; returns the push's gap."""
        sample, previous = await self._learner_side(side), self._last_probe
        if previous is not None and not unchanged and engine_kept_its_weights(previous, sample):
            moved = float((sample.learner_logprobs - previous.learner_logprobs).abs().max())
            raise StaleWeightsError(
                f"after the weight sync of policy version {side.version}: vLLM computed the previous push's probe "
                f"bit for bit while the learner's logprobs of it moved by {moved:.3e}; the engine is not "
                "sampling from the weights being trained")
        self._last_probe = sample
        gap = self._gap(sample)
        if gap > self.probe_tolerance.value:
            raise StaleWeightsError(
                f"after the weight sync of policy version {side.version}: vLLM's logprobs differ from the "
                f"learner's by {gap:.3e} (> {self.probe_tolerance.value:.3e} = max(schedule.probe_tolerance, "
                f"schedule.probe_noise_margin x the noise floor {self.probe_tolerance.floor:.2e})); the engine "
                "is not sampling from the weights being trained")
        self.probe_tolerance.accept(gap)
        return gap

    async def _calibrate_probe(self) -> None:
        """The noise floor, on the same weights: other continuations scored the probe's way. A floor
        above ``probe_max_noise_floor`` is not numerics. Then the decode path, once: vLLM's logprobs
        of its own samples against the learner's at the run's temperature (of the unscaled logits
        under ``logprobs_mode: raw_logprobs``) must be within the tolerance too."""
        sched = self.cfg.schedule
        prompt = self._probe_prompt()
        processed = self.cfg.rollout.engine.logprobs_mode == "processed_logprobs"
        sampled_at = self.cfg.rollout.temperature if processed else 1.0
        scored, sampled = [], []
        for k in range(sched.probe_calibration_probes):
            draw = await self._draw_continuation(seed=1 + k)
            scored.append(self._gap(await self._probe_sample(draw.token_ids)))
            tokens = prompt + draw.token_ids  # the probe's prefill computed (and routed) every position
            learner = await self.service.call(LearnerEndpoint.score, tokens, len(prompt), await self._routed(tokens),
                                              sampled_at)
            sampled.append(max_logprob_gap(draw.logprobs, learner))
        self.probe_tolerance.calibrate(scored)
        if max(scored) > sched.probe_max_noise_floor:
            raise StaleWeightsError(
                f"on the same weights vLLM's logprobs differ from the learner's by {max(scored):.3e} (> "
                f"schedule.probe_max_noise_floor={sched.probe_max_noise_floor:g}): not numerics; the engine "
                "and the learner compute different models (RoPE scaling, vocabulary, layout?)")
        if max(sampled) > self.probe_tolerance.value:
            raise StaleWeightsError(
                f"vLLM's logprobs of its own samples differ from the learner's softmax(logits / {sampled_at:g}) by "
                f"{max(sampled):.3e} (> the probe's tolerance {self.probe_tolerance.value:.3e}) while its scores of "
                "the same tokens agree: the engine samples another distribution than the one trained (temperature?)")

    def _probe_prompt(self) -> list[int]:
        return list(self.codec.prompt_ids(self.task.messages(self.instances(0)[0]), self.task.tool_schemas()))

    async def _draw_continuation(self, seed: int) -> Completion:
        """``schedule.probe_tokens`` tokens vLLM samples after the probe's prompt at the run's temperature."""
        params = SamplingParams(max_new_tokens=self.cfg.schedule.probe_tokens, temperature=self.cfg.rollout.temperature,
                                seed=seed, ignore_eos=True)
        return await self.engine.generate(self._probe_prompt(), params, session_id=PROBE_SESSION)

    async def _probe_sample(self, continuation: Sequence[int] | None = None) -> ProbeSample:
        """vLLM's and the learner's logprobs (temperature 1) of the probe's tokens: ``continuation``,
        or the one every push is probed with (drawn with ``PROBE_SEED`` the first time)."""
        return await self._learner_side(await self._engine_side(continuation))

    async def _engine_side(self, continuation: Sequence[int] | None = None) -> _EngineSide:
        """vLLM's part of a probe: one prefill of the prompt and ``continuation`` (default: the
        push's own) and one sampled token, with the experts it routed to under routing replay."""
        if continuation is None:
            if self._probe_continuation is None:
                self._probe_continuation = (await self._draw_continuation(seed=PROBE_SEED)).token_ids
            continuation = self._probe_continuation
        prompt = self._probe_prompt()
        out = await engine_probe(self.engine, prompt, continuation)
        if out.policy_version != self.version:
            raise StaleWeightsError(f"after the weight sync of policy version {self.version}: vLLM sampled with "
                                    f"version {out.policy_version}")
        tokens = prompt + out.tokens
        return _EngineSide(self.version, prompt, out.tokens, out.logprobs, await self._routed(tokens))

    async def _learner_side(self, side: _EngineSide) -> ProbeSample:
        """The learner's logprobs of the tokens vLLM probed (routed as vLLM routed them under
        routing replay; the gap without replay is reported beside it)."""
        tokens = side.prompt + side.tokens
        if side.routed is not None:
            own = await self.service.call(LearnerEndpoint.score, tokens, len(side.prompt), None, 1.0)
            self.last_probe_gap_own_routing = max_logprob_gap(side.logprobs, own)
        learner_logp = await self.service.call(LearnerEndpoint.score, tokens, len(side.prompt), side.routed, 1.0)
        return ProbeSample(tuple(side.tokens), tuple(side.logprobs), learner_logp)

    async def _routed(self, tokens: list[int]) -> torch.Tensor | None:
        """Routing replay: the experts vLLM's probe request routed ``tokens`` to (None without it)."""
        routing = self.agent_loop.routing
        if routing is None:
            return None
        return torch.from_numpy((await routing.routed_experts(tokens, session_id=PROBE_SESSION)).copy())

    @staticmethod
    def _gap(sample: ProbeSample) -> float:
        return max_logprob_gap(sample.engine_logprobs, sample.learner_logprobs)

    # ------------------------------------------------------------------ records

    def _row(self, step: int, rec: StepRecord, outcome: BatchOutcome, result: StepResult) -> dict:
        now = time.monotonic()
        eps = rec.episodes
        rewards = [r for r in (e.trained_reward for e in eps) if r is not None]
        lags = [self.version - 1 - min((t.policy_version for t in e.turns), default=self.version - 1) for e in eps]
        busy = self.service.busy_seconds(rec.started, now)
        step_s = now - rec.started
        wall = self.wall_offset + now - self.t0
        return {
            "step": step,
            "schedule": rec.schedule or self.cfg.schedule.mode,
            "reward_mean": sum(rewards) / max(len(rewards), 1),
            "num_episodes": len(eps),
            "num_failed": len(eps) - len(rewards),
            "kept_groups": outcome.num_kept_groups,
            "dropped_groups": outcome.num_dropped_groups,
            "dropped_stale_groups": rec.dropped_stale,
            "generated_tokens": sum(sum(e.loss_mask) for e in eps),
            "policy_lag_max": max(lags, default=0),
            "policy_lag_mean": sum(lags) / max(len(lags), 1),
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            **self.last_push,  # the last push: seconds (update_weights), bytes sent, changed fraction, probe_s
            **({"engine_restarts": self.engine.num_restarts} if isinstance(self.engine, InProcessEngine) else {}),
            "step_s": step_s,
            "learner_busy_s": busy,
            "learner_idle_share": max(0.0, 1.0 - busy / step_s) if step_s > 0 else 0.0,
            "backward_after_last_reward": outcome.backward_after_last_reward,
            "peak_buffers": outcome.peak_buffers,  # the ledger's parameter-sized buffers at their peak
            "peak_buffer_bytes": outcome.peak_device_bytes,  # ... their bytes on the learner's device
            "peak_buffer_host_bytes": outcome.peak_host_bytes,  # ... in host memory (ledger.slot_placement)
            "ledger_slots": outcome.max_group_slots,  # K in force (null: unbounded)
            "peak_pending": outcome.peak_pending,  # pending h_i buffers at their peak (in peak_buffers too)
            "pending_backward": outcome.num_pending_backward,  # score backwards run at finish (ledger.max_pending)
            "turn_scores": outcome.num_turn_scores,  # trajectories whose h_i ran turn by turn (ledger.per_turn_scores)
            **({} if outcome.divergence is None else {_divergence_key(self.cfg): outcome.divergence}),
            "wall_s": wall,
            "gpu_hours": wall * self.service.world_size / 3600.0,  # learner process-hours on CPU
        }

    def _probe_columns(self) -> dict:
        """The last push's probe (async: the push at this step's start), once it is checked."""
        return {"probe_gap": self.last_probe_gap, "probe_tolerance": self.probe_tolerance.value,
                **({"probe_gap_own_routing": self.last_probe_gap_own_routing} if self.agent_loop.routing else {})}

    def _journal(self, step: int, rec: StepRecord, row: dict) -> None:
        for ep in rec.episodes:
            self.journal.trajectory(step, ep.to_trajectory(), reward=ep.trained_reward, instance_id=ep.instance_id,
                                    t_finished=ep.finished_at - rec.started, t_reward=ep.reward_time - rec.started,
                                    policy_versions=[t.policy_version for t in ep.turns],
                                    stop_reason=ep.stop_reason, failure=ep.failure,
                                    verifier=None if ep.reward is None else
                                    {"detail": ep.reward.detail, "tests": ep.reward.as_payload()["tests"]})  # fmt: skip
        self.journal.end_step(step, row)

    def _keep_timeline_from(self, first_step: int) -> None:
        """The timeline's spans of steps >= ``first_step`` only (``run.timeline_steps``)."""
        self.service.forget_spans_before(first_step)
        self.timeline.keep_from(first_step)

    def _checkpoint_due(self, step: int) -> bool:
        every = self.cfg.run.checkpoint_every
        return bool(every) and (step + 1) % every == 0 and step + 1 < self.cfg.run.num_steps

    def _show_progress(self, row: dict) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{row['reward_mean']:.3f}", lag=row["policy_lag_max"],
                                 idle=f"{row['learner_idle_share']:.0%}")


def _divergence_key(cfg: Config) -> str:
    """The OPD metric's name: opd/reverse_kl (mean over trained tokens of l - l^T, the sampled-token
    estimate of KL(student || teacher) on the student's own samples) or opd/gjsd."""
    return f"opd/{getattr(cfg.objective, 'divergence', 'reverse_kl')}"


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
