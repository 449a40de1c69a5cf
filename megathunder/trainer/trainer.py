"""The trainer: rollout and learner wired together under one of four schedules.

    rank 0:  controller + rollout (vLLM engine, agent loop)   -- an asyncio loop
             learner calls -> LearnerService (worker thread; broadcast to the other ranks)
    others:  LearnerService.serve()  (the same learner calls, in the same order)

Per optimizer step: episodes run on the engine; their events become learner calls
(``begin`` / ``turn`` (OPD) / ``finished`` / ``reward`` / ``close``); then ``step``, the new weights are gathered,
resharded to the inference layout and pushed into vLLM, and the zero-staleness probe checks that
vLLM now samples from exactly the weights being trained. Everything is journaled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from megathunder.config import Config
from megathunder.rollout.agent_loop import Episode
from megathunder.learner.batches import BatchGradient
from megathunder.trainer.journal import Journal
from megathunder.trainer.metrics import MetricsLog
from megathunder.learner.service import LearnerService
from megathunder.trajectory import Trajectory
from megathunder.weight_sync import StaleWeightsError, inference_weights, max_logprob_gap

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- learner calls (all ranks)


def learner_handlers(learner, checkpoint_dir: Path, teacher=None) -> dict:
    """The calls the controller makes; each runs on every learner rank. ``teacher``: OPD's
    (``objective.kind: opd`` or ``opd_grpo``); the batch is then an ``OPDBatch``, which also takes ``turn``."""
    from megathunder.learner.checkpoint import save_checkpoint

    state: dict = {}

    def begin(plan, streamed):
        state["batch"] = new_batch(learner, teacher, plan, streamed)

    def score(tokens: list[int], prompt_len: int):
        mask = torch.zeros(len(tokens) - 1, dtype=torch.bool)
        mask[prompt_len - 1 :] = True
        traj = Trajectory(traj_id=-1, group_id=-1, tokens=torch.tensor(tokens), loss_mask=mask)
        out = learner.token_logprobs([traj])
        return _from_last_stage(learner.groups, None if out is None else out[0][prompt_len - 1 :])

    return {
        "begin": begin,
        "turn": lambda tid, tokens, start, end: state["batch"].on_turn(tid, tokens, start, end),
        "finished": lambda traj: state["batch"].on_finished(traj),
        "reward": lambda tid, reward: state["batch"].on_reward(tid, reward),
        "close": lambda: state.pop("batch").close(),
        "step": learner.step,
        "gather_weights": lambda: inference_weights(learner),
        "score": score,
        "checkpoint": lambda: str(save_checkpoint(learner, checkpoint_dir)),
        "export": lambda path: learner.export_hf(path),
    }


def new_batch(learner, teacher, plan, streamed: bool):
    """The batch's gradient accumulator: RL (``BatchGradient``) or, with a teacher, ``OPDBatch``
    (``OPDGRPOBatch`` for ``objective.kind: opd_grpo``)."""
    if teacher is None:
        return BatchGradient(learner, plan, streamed)
    from megathunder.trainer.opd import OPDBatch, OPDGRPOBatch

    return (OPDGRPOBatch if learner.objective.kind == "opd_grpo" else OPDBatch)(learner, teacher, plan, streamed)


def _from_last_stage(groups, value):
    """A value computed on the last pipeline stage, on rank 0 too."""
    if groups.dims.pp == 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(groups.pp, groups.dims.pp - 1), group=groups.pp)
    return box[0]


# ---------------------------------------------------------------------- the controller (rank 0)


@dataclass
class StepRecord:
    """What one optimizer step trained on and how long things took (for metrics and timeline)."""

    episodes: list[Episode]
    started: float  # time.monotonic() when the step's wait for data began
    dropped_stale: int = 0


class Trainer:
    def __init__(self, cfg: Config, out: Path, service: LearnerService, engine, codec, agent_loop,
                 task, start_step: int) -> None:
        self.cfg, self.out, self.service = cfg, out, service
        self.engine, self.codec, self.loop, self.task = engine, codec, agent_loop, task
        self.start_step = start_step
        self.version = start_step  # the learner's policy version == optimizer steps taken
        self.journal = Journal(out / "journal.jsonl", keep_steps=start_step)
        self.metrics = MetricsLog(out, cfg, keep_steps=start_step)
        self.t0 = time.monotonic()
        self.wall_offset = self.metrics.rows[-1]["wall_s"] if self.metrics.rows else 0.0
        self.episode_spans: list[dict] = []  # for the timeline
        self.sync_spans: list[tuple[float, float, int]] = []
        self.last_probe_gap = float("nan")
        self.eval_set = None
        self.bar = None
        self._streaming = False  # thunder: route the rollout's events to the learner
        agent_loop.emit = self._on_event

    def _keep_timeline_from(self, first_step: int) -> None:
        """The timeline's spans of steps >= ``first_step`` only (``run.timeline_steps``)."""
        self.service.forget_spans_before(first_step)
        self.episode_spans = [e for e in self.episode_spans if e["step"] >= first_step]
        self.sync_spans = [s for s in self.sync_spans if s[2] >= first_step]  # version v follows step v - 1

    # ------------------------------------------------------------------ rollout

    def instances(self, step: int):
        """Step ``step``'s prompts: distinct, reproducible, never from the evaluation split."""
        from megathunder.rollout.tasks.split import training_instances

        return training_instances(self.cfg, self.task, self.cfg.batch.num_prompts_per_batch,
                                  seed=self.cfg.run.seed * 1_000_003 + step)

    async def rollout(self, step: int, stream: bool = False) -> list[Episode]:
        """One batch of episodes (group g = instance g); ``stream`` routes events to the learner."""
        self._streaming = stream
        try:
            return await self.loop.run_batch(self.instances(step), self.cfg.batch.samples_per_prompt,
                                             seed=self.cfg.run.seed * 7919 + step)
        finally:
            self._streaming = False

    def _on_event(self, event) -> None:
        if not self._streaming:
            return
        if event.kind == "turn_finished" and self.cfg.objective.kind in ("opd", "opd_grpo"):  # its tool call starts now
            p = event.payload
            self.service.submit("turn", event.traj_id, p["token_ids"], p["start"], p["end"])
        elif event.kind == "trajectory_finished":
            self.service.submit("finished", event.payload["episode"].to_trajectory())
        elif event.kind == "reward":
            self.service.submit("reward", event.traj_id, _reward(event.payload))

    def plan(self) -> list[tuple[int, list[int]]]:
        s = self.cfg.batch.samples_per_prompt
        return [(g, [g * s + k for k in range(s)]) for g in range(self.cfg.batch.num_prompts_per_batch)]

    # ------------------------------------------------------------------ learner side of a step

    async def train_at_end(self, episodes: list[Episode]):
        """The batch-synchronous path: every event of the batch, then the gradient."""
        plan, trajs, rewards = as_batch(episodes)
        self.service.submit("begin", plan, False)
        for ep, traj in sorted(zip(episodes, trajs), key=lambda p: p[0].finished_at):
            self.service.submit("finished", traj)
        for tid, reward in rewards:
            self.service.submit("reward", tid, reward)
        return await self.service.call("close")

    async def finish_step(self, step: int, rec: StepRecord, outcome, push: bool = True) -> dict:
        result = await self.service.call("step")
        self.version += 1
        if push:
            await self.push_weights()
        probe_gap = self.last_probe_gap  # async: the push (and its probe) at this step's start
        row = self._row(step, rec, outcome, result, probe_gap)
        row.update(await self.periodic_eval(step))
        for ep in rec.episodes:
            self.journal.trajectory(step, ep.to_trajectory(), reward=_reward_of(ep), instance_id=ep.instance_id,
                                    t_finished=ep.finished_at - rec.started, t_reward=_reward_time(ep) - rec.started,
                                    policy_versions=[t.policy_version for t in ep.turns],
                                    stop_reason=ep.stop_reason, failure=ep.failure)  # fmt: skip
        self.journal.end_step(step, row)
        self.metrics.log(row)
        self._keep_timeline_from(step + 1 - self.cfg.run.timeline_steps)
        every = self.cfg.run.checkpoint_every
        if every and (step + 1) % every == 0 and step + 1 < self.cfg.run.num_steps:
            await self.service.call("checkpoint")
        self.service.step = step + 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{row['reward_mean']:.3f}", lag=row["policy_lag_max"],
                                 idle=f"{row['learner_idle_share']:.0%}")
        return row

    async def periodic_eval(self, step: int, force: bool = False) -> dict:
        """pass@1..k on the held-out instances with the weights just pushed (``eval.every_n_steps``)."""
        from megathunder.eval.evaluate import evaluate
        from megathunder.eval.instances import eval_due, eval_instances

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

    async def push_weights(self) -> float:
        """Gather + reshard on the learner, load into vLLM, then probe; returns the probe's gap."""
        start = time.monotonic()
        weights = await self.service.call("gather_weights")
        await self.engine.update_weights(weights, self.version)
        gap = self.last_probe_gap = await self.probe()
        self.sync_spans.append((start, time.monotonic(), self.version))
        return gap

    async def probe(self) -> float:
        from megathunder.rollout.types import SamplingParams

        n = self.cfg.schedule.probe_tokens
        if n == 0:
            return float("nan")
        prompt = self.codec.prompt_ids(self.task.messages(self.instances(0)[0]))
        out = await self.engine.generate(prompt, SamplingParams(max_new_tokens=n, temperature=1.0, seed=self.version,
                                                                ignore_eos=True))
        learner_logp = await self.service.call("score", list(prompt) + list(out.token_ids), len(prompt))
        gap = max_logprob_gap(out.logprobs, learner_logp)
        if out.policy_version != self.version or gap > self.cfg.schedule.probe_tolerance:
            raise StaleWeightsError(
                f"after the weight sync of policy version {self.version}: vLLM sampled with version "
                f"{out.policy_version} and its logprobs differ from the learner's by {gap:.3e} (> "
                f"schedule.probe_tolerance={self.cfg.schedule.probe_tolerance:g}); the engine is not "
                "sampling from the weights being trained"
            )
        return gap

    # ------------------------------------------------------------------ metrics

    def _row(self, step: int, rec: StepRecord, outcome, result, probe_gap: float) -> dict:
        now = time.monotonic()
        eps = rec.episodes
        rewards = [r for r in (_reward_of(e) for e in eps) if r is not None]
        lags = [self.version - 1 - min((t.policy_version for t in e.turns), default=self.version - 1) for e in eps]
        busy = self.service.busy_seconds(rec.started, now)
        step_s = now - rec.started
        wall = self.wall_offset + now - self.t0
        for e in eps:
            self.episode_spans.append({
                "step": step, "start": e.started_at, "finished": e.finished_at, "reward": _reward_time(e),
                "turns": len(e.turns), "group": e.group_id, "prompt_tokens": e.prompt_len,
                "tokens": len(e.token_ids), "turn_spans": [
                    (t.started_at, t.generated_at, t.tools_done_at, t.end - t.start) for t in e.turns],
            })  # fmt: skip
        return {
            "step": step,
            "schedule": self.cfg.schedule.mode,
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
            "probe_gap": probe_gap,
            "step_s": step_s,
            "learner_busy_s": busy,
            "learner_idle_share": max(0.0, 1.0 - busy / step_s) if step_s > 0 else 0.0,
            "backward_after_last_reward": outcome.backward_after_last_reward,
            "peak_buffers": outcome.peak_buffers,
            **({} if outcome.divergence is None else {_divergence_key(self.cfg): outcome.divergence}),
            "wall_s": wall,
            "gpu_hours": wall * self.service.world_size / 3600.0,  # learner process-hours on CPU
        }


# ---------------------------------------------------------------------- helpers


def _divergence_key(cfg: Config) -> str:
    """The OPD metric's name: opd/reverse_kl (mean over trained tokens of l - l^T, the sampled-token
    estimate of KL(student || teacher) on the student's own samples) or opd/gjsd."""
    return f"opd/{cfg.learner.opd.divergence}"


def _reward(payload: dict) -> float | None:
    if payload.get("drop_group"):
        return None
    r = payload.get("reward")
    return None if r is None or not math.isfinite(r) else float(r)


def _reward_of(ep: Episode) -> float | None:
    return None if ep.reward is None else _reward(ep.reward.as_payload())


def _reward_time(ep: Episode) -> float:
    if ep.rewarded_at is not None:
        return ep.rewarded_at
    return ep.finished_at + (ep.reward.duration_s if ep.reward is not None else 0.0)


def as_batch(episodes: list[Episode]):
    """Renumber episodes (grouped, in sample order) into a batch plan, trajectories and rewards."""
    groups: dict[int, list[Episode]] = {}
    for ep in episodes:
        groups.setdefault(ep.group_id, []).append(ep)
    plan, trajs, rewards, tid = [], [], [], 0
    for g, (_, members) in enumerate(groups.items()):
        ids = []
        for ep in sorted(members, key=lambda e: e.traj_id):
            traj = ep.to_trajectory()
            traj.traj_id, traj.group_id = tid, g
            trajs.append(traj)
            rewards.append((tid, _reward_of(ep)))
            ids.append(tid)
            tid += 1
        plan.append((g, ids))
    return plan, trajs, rewards


def write_summary(out: Path, rows: list[dict]) -> dict:
    k = max(1, len(rows) // 5)
    mean = lambda key, rs: sum(r[key] for r in rs) / max(len(rs), 1)  # noqa: E731
    summary = {
        "schedule": rows[-1]["schedule"] if rows else None,
        "steps": len(rows),
        "reward_first_steps": round(mean("reward_mean", rows[:k]), 4),
        "reward_last_steps": round(mean("reward_mean", rows[-k:]), 4),
        "mean_step_s": round(mean("step_s", rows), 3),
        "learner_idle_share": round(mean("learner_idle_share", rows), 4),
        "max_policy_lag": max((r["policy_lag_max"] for r in rows), default=0),
        "max_probe_gap": max((r["probe_gap"] for r in rows if not math.isnan(r["probe_gap"])), default=float("nan")),
        "mean_backward_after_last_reward": round(mean("backward_after_last_reward", rows), 3),
        "wall_s": round(rows[-1]["wall_s"], 1) if rows else 0.0,
    }
    for key in ("opd/reverse_kl", "opd/gjsd"):
        if rows and key in rows[0]:
            summary[f"{key}_first_steps"] = round(mean(key, rows[:k]), 4)
            summary[f"{key}_last_steps"] = round(mean(key, rows[-k:]), 4)
    evals = [r for r in rows if "eval/pass@1" in r]
    if evals:
        summary["eval_pass@1_first"] = round(evals[0]["eval/pass@1"], 4)
        summary["eval_pass@1_last"] = round(evals[-1]["eval/pass@1"], 4)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def print_summary(summary: dict, out: Path) -> None:
    print(f"\n{'metric':<34} value")
    for key, value in summary.items():
        print(f"{key:<34} {value:.4g}" if isinstance(value, float) else f"{key:<34} {value}")
    print(f"run directory: {out}  (metrics.jsonl, journal.jsonl, timeline.png, trace.json, checkpoints/)")
    print(json.dumps(summary))
