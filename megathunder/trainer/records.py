"""What a step leaves behind: its metrics row, journal records, timeline, evaluation and checkpoint.

A step's row is taken when its update is pushed (``StepRecords.row``: the step's time ends there);
it is written once the push's probe is checked (``StepRecords.write``): at once, or -- when the
probe's learner part trails into the next batch (``probe.overlap``) -- as soon as that part is
scored, while the next batch generates. Nothing follows such a step but its records (no
evaluation, checkpoint or chaos fault: ``Trainer.may_trail``), so nothing is reordered.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol
from pathlib import Path

from tqdm import tqdm

from megathunder.config import Config
from megathunder.learner.batches import BatchOutcome
from megathunder.learner.client import LearnerClient
from megathunder.learner.learner import StepResult
from megathunder.plan.flops import Utilisation
from megathunder.rollout.episode import Episode
from megathunder.trainer.journal import Journal
from megathunder.trainer.metrics import MetricsLog
from megathunder.trainer.timeline import Timeline


@dataclass
class StepRecord:
    """What one optimizer step trained on and how long things took (for metrics and timeline)."""

    episodes: list[Episode]
    started: float  # time.monotonic() when the step's wait for data began
    dropped_stale: int = 0
    schedule: str | None = None  # the path the step took, when not schedule.mode's (a paired benchmark)


class AfterStep(Protocol):
    """A hook run once a step's records are written, before its checkpoint (``chaos.faults``' after-step
    faults: a full disk meets that checkpoint)."""

    def __call__(self, step: int) -> None: ...

    def acts_after(self, step: int) -> bool:
        """Does it act after ``step``'s records (then no probe trails past that step)?"""
        ...


class StepRecords:
    """The run's records (module docstring). ``evaluate(step)``: the periodic evaluation's metrics
    after ``step`` ({} when none is due); ``after_step``: hooks installed to run once a step's
    records are written (``AfterStep``); ``flops``: the run's per-step MFU and HFU (on GPUs)."""

    def __init__(self, cfg: Config, out: Path, learner: LearnerClient, start_step: int,
                 evaluate: Callable[[int], Awaitable[dict]], flops: Utilisation | None = None) -> None:
        self.cfg, self.learner, self.evaluate, self.flops = cfg, learner, evaluate, flops
        self.after_step: list[AfterStep] = []
        self.bar: tqdm | None = None
        self.journal = Journal(out / "journal.jsonl", keep_steps=start_step)
        self.metrics = MetricsLog(out, cfg, keep_steps=start_step)
        self.timeline = Timeline()
        self.t0 = time.monotonic()  # until ``start_clock``: set-up (the first push, the evaluation before RL)
        self.setup_s = 0.0
        self.wall_offset = self.metrics.rows[-1]["wall_s"] if self.metrics.rows else 0.0

    def row(self, step: int, rec: StepRecord, outcome: BatchOutcome, result: StepResult, version: int,
            extra: dict) -> dict:
        """The step's metrics, timed now (its update pushed); ``extra``: the push's figures and
        other components' columns."""
        now = time.monotonic()
        eps = rec.episodes
        rewards = [r for r in (e.trained_reward for e in eps) if r is not None]
        lags = [version - 1 - min((t.policy_version for t in e.turns), default=version - 1) for e in eps]
        busy = self.learner.service.busy_seconds(rec.started, now)
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
            **extra,
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
            "skipped_zero_advantage": outcome.num_skipped,  # no pass: advantage 0 (objective.skip_zero_advantage)
            **({} if outcome.divergence is None else {_divergence_key(self.cfg): outcome.divergence}),
            "wall_s": wall,
            "gpu_hours": wall * self.learner.world_size / 3600.0,  # learner process-hours on CPU
            # on GPUs: the step's model (and hardware) FLOPs over its wall time on the learner's devices
            **({} if self.flops is None else
               self.flops.columns((len(e.token_ids) - 1 for e in eps if e.trained_reward is not None), step_s)),
        }

    async def write(self, step: int, rec: StepRecord, row: dict, columns: dict) -> None:
        """The step's records: ``columns`` (the checked probe's) into its row, evaluation when due,
        journal, metrics, the after-step hooks, timeline, checkpoint when due, the progress bar."""
        row.update(columns)
        row.update(await self.evaluate(step))
        self._journal(step, rec, row)
        self.metrics.log(row)
        for hook in self.after_step:
            hook(step)
        self.timeline.add_episodes(step, rec.episodes)
        self._keep_timeline_from(step + 1 - self.cfg.run.timeline_steps)
        if self.checkpoint_due(step):
            await self.learner.checkpoint()
        service = self.learner.service
        service.step_index = max(service.step_index, step + 1)
        self._show_progress(row)

    def acts_after(self, step: int) -> bool:
        """Does an after-step hook act after ``step``'s records?"""
        return any(hook.acts_after(step) for hook in self.after_step)

    def checkpoint_due(self, step: int) -> bool:
        every = self.cfg.run.checkpoint_every
        return bool(every) and (step + 1) % every == 0 and step + 1 < self.cfg.run.num_steps

    def start_clock(self) -> None:
        """The run's clock (``wall_s``, ``gpu_hours``) starts at its first step: what comes before it
        (loading, the first push, the evaluation before RL; slower on a cold first run) is
        ``setup_s``, reported apart, so that time to a score compares runs like with like."""
        now = time.monotonic()
        self.setup_s, self.t0 = now - self.t0, now

    def show_progress(self, num_steps: int, desc: str, enabled: bool) -> None:
        """A progress bar over the steps to come, advanced as each step's records are written."""
        self.bar = tqdm(total=num_steps, desc=desc, unit="step", disable=not enabled, mininterval=1.0)

    def close_progress(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def close(self) -> None:
        self.close_progress()
        self.metrics.close()
        self.journal.close()

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
        self.learner.service.forget_spans_before(first_step)
        self.timeline.keep_from(first_step)

    def _show_progress(self, row: dict) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{row['reward_mean']:.3f}", lag=row["policy_lag_max"],
                                 idle=f"{row['learner_idle_share']:.0%}")


def _divergence_key(cfg: Config) -> str:
    """The OPD metric's name: opd/reverse_kl (mean over trained tokens of l - l^T, the sampled-token
    estimate of KL(student || teacher) on the student's own samples) or opd/gjsd."""
    return f"opd/{getattr(cfg.objective, 'divergence', 'reverse_kl')}"
