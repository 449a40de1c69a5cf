"""``megathunder train``: set up a run (or resume it), train, and write its report.

    pgs   = init_distributed(cfg.learner)                # TP x PP x DP, gloo or NCCL
    task     = build_task(cfg.task)                           # once per run: SFT, rollouts, evaluation
               check_before_training(cfg, task, ...)          # task.check_before_training: bad tasks out
    model    = initial_model(cfg, task, out, pgs)             # HF directory (+ SFT): learner and vLLM load it
    learner  = MegatronLearner.build(...); resume from checkpoints/latest
    teacher  = objective.kind=opd/opd_grpo: frozen Megatron model (given, or built: tiny model + SFT)
    rank 0:  engine, agent loop -> Trainer -> SCHEDULES[cfg.schedule.mode]
    others:  LearnerService.serve()
    rank 0:  timeline.png / trace.json, summary.json, checkpoint

Stopping (``megathunder.trainer.interrupt``): SIGUSR1 (Slurm's ``--signal=B:USR1@T`` forwarded by
the launch script) or a first Ctrl-C ends the step loop after the current step; rank 0 saves a
checkpoint and the command exits with STOPPED_EARLY (75), so the script can requeue the job and the
same command resumes from checkpoints/latest. SIGTERM or a second Ctrl-C stops at once (130).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from transformers import AutoTokenizer

from megathunder.config import Config, ConfigError
from megathunder.host import HostTuning, freeze_startup_heap
from megathunder.learner.checkpoint import latest_checkpoint, load_checkpoint
from megathunder.learner.client import LearnerClient
from megathunder.learner.endpoint import LearnerEndpoint
from megathunder.learner.parallel import init_distributed
from megathunder.learner.pack_window import PackWindow
from megathunder.learner.service import LearnerRankLost, LearnerService
from megathunder.learner.teacher import build_teacher
from megathunder.plan.flops import Utilisation
from megathunder.plan.memory_plan import ModelShape
from megathunder.rollout.chat_template import make_codec
from megathunder.rollout.engines import start_engine
from megathunder.rollout.engines.inprocess import EngineRestartError, EngineUpdateError, InProcessEngine
from megathunder.rollout.sandbox import close_sandbox_pools, sandbox_server_counts
from megathunder.rollout.tasks import build_task
from megathunder.rollout.tasks.task import Task
from megathunder.rollout.tasks.task_check import check_before_training
from megathunder.rollout.types import RolloutEngine
from megathunder.trainer.chaos import Chaos, ChaosStop, check_learner_faults, learner_controls
from megathunder.trainer.interrupt import STOPPED_EARLY, STOPPED_NOW, StopNow, StopSignals
from megathunder.trainer.schedules import SCHEDULES, Schedule
from megathunder.trainer.setup import barrier, build_learner, build_teacher_model, initial_model
from megathunder.trainer.summary import print_summary, write_summary
from megathunder.trainer.trainer import Trainer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Extras:
    """What a caller adds to a run without the product code knowing of it (benchmarks, tests):
    ``schedule`` in place of ``SCHEDULES[schedule.mode]``; ``install(trainer)``, run once the
    trainer is built, wraps its parts (e.g. the benchmarks' stand-in latencies)."""

    schedule: Schedule | None = None
    install: Callable[[Trainer], None] | None = None


class StepsUntilSignal:
    """``range(start, stop)`` that ends early once ``stop_requested`` is set (checked before each step)."""

    def __init__(self, steps: range, stop_requested: threading.Event) -> None:
        self.start, self.stop, self._steps, self._stop_requested = steps.start, steps.stop, steps, stop_requested

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self):
        for step in self._steps:
            if self._stop_requested.is_set():
                return
            yield step


def prepare_run_dir(cfg: Config) -> Path:
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def train_command(cfg: Config, extras: Extras = Extras()) -> int:
    """``train``, with the failures a run reports in one line (exit 1) instead of a traceback."""
    from megathunder.diskspace import DiskFullError
    from megathunder.rollout.engines.server import ServerError
    from megathunder.rollout.sandbox import SandboxError

    try:
        return train(cfg, extras)
    except (LearnerRankLost, DiskFullError, ServerError, EngineRestartError, EngineUpdateError, SandboxError) as err:
        print(f"megathunder: {err}", file=sys.stderr, flush=True)
        return 1


def train(cfg: Config, extras: Extras = Extras()) -> int:
    signals = StopSignals()  # every rank: SIGUSR1's default action would kill the process
    try:
        return _train(cfg, signals, extras)
    except ChaosStop as err:  # chaos.faults: a crash, as injected
        print(f"megathunder: {err}", file=sys.stderr, flush=True)
        return STOPPED_NOW
    except (StopNow, asyncio.CancelledError):
        if signals.now.is_set():
            print(f"megathunder: stopped now; the same command resumes from the last checkpoint in "
                  f"{Path(cfg.run.output_dir) / 'checkpoints'} (if any)", file=sys.stderr, flush=True)
            return STOPPED_NOW
        raise


def check_engine_placement(cfg: Config, cuda: bool) -> None:
    """On a GPU machine the in-process engine runs in learner rank 0's process, on its GPU, where
    vLLM takes ``gpu_memory_utilization`` (0.9 by default) of the learner's memory: refused unless
    that share was set (as ``megathunder plan`` shows it fits; the launch scripts run servers)."""
    engine = cfg.rollout.engine
    if cuda and engine.deployment == "in_process" and "gpu_memory_utilization" not in engine.model_fields_set:
        raise ConfigError(
            "rollout.engine.deployment: in_process on a GPU puts vLLM on learner rank 0's GPU, taking "
            f"rollout.engine.gpu_memory_utilization={engine.gpu_memory_utilization:g} of it; run the engine as servers "
            "on GPUs of their own (deployment=server), or set gpu_memory_utilization to a share `megathunder plan` "
            "shows fits beside the learner")


def _train(cfg: Config, signals: StopSignals, extras: Extras) -> int:
    check_engine_placement(cfg, torch.cuda.is_available())
    host = HostTuning(cfg)  # on the machine itself (a config may be written elsewhere), before anything starts
    out = prepare_run_dir(cfg)
    pgs = init_distributed(cfg.learner)
    check_learner_faults(cfg.chaos.faults, pgs.world_size)  # every rank: all stop before any work
    ckpt_dir = out / "checkpoints"
    latest = latest_checkpoint(ckpt_dir) if cfg.run.resume else None
    if pgs.rank == 0:
        if latest is None:  # a fresh run: nothing of an earlier one may be mixed in
            for name in ("journal.jsonl", "metrics.jsonl", ".wandb_id"):
                (out / name).unlink(missing_ok=True)
            if not cfg.run.resume:  # else faults fired before a first checkpoint stay fired (no re-fire loop)
                (out / "chaos.jsonl").unlink(missing_ok=True)
            for name in ("checkpoints", "wandb"):
                shutil.rmtree(out / name, ignore_errors=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    barrier()
    task = build_task(cfg.task)
    check_before_training(cfg, task, out, rank=pgs.rank, barrier=barrier)  # task.check_before_training: bad tasks out
    model_dir = initial_model(cfg, task, out, pgs)
    learner = build_learner(cfg, pgs, model_dir)
    teacher = None
    if cfg.objective.needs_teacher:  # a frozen Megatron teacher in the student's layout
        teacher = build_teacher(build_teacher_model(cfg, task, out, pgs), cfg.learner, pgs)
    if latest is not None:
        load_checkpoint(learner, latest)
        if pgs.rank == 0:
            print(f"megathunder: resumed from {latest} (step {learner.num_steps})", flush=True)
    start = learner.num_steps
    watchdog = cfg.learner.watchdog
    service = LearnerService(LearnerEndpoint(learner, ckpt_dir, teacher), pgs.rank, pgs.world_size,
                             heartbeat_timeout_s=watchdog.heartbeat_timeout_s, call_timeout_s=watchdog.call_timeout_s,
                             window=PackWindow(cfg.ledger.pack_window_s), cpu_cores=host.learner_cores,
                             controls=learner_controls(cfg.chaos.faults, pgs.rank))
    if pgs.rank != 0:
        with host.follower():  # computes on its main thread
            service.serve()
        return 0
    try:
        with host.controller():
            flops = Utilisation.on_this_device(ModelShape.of(learner.model_cfg), cfg.learner.activations.recompute,
                                               pgs.world_size)
            summary = asyncio.run(_control(cfg, task, out, service, model_dir, start, signals, extras, host, flops))
    finally:
        service.stop(cancel_pending=signals.now.is_set())
    status = STOPPED_EARLY if summary == STOPPED_EARLY else 0 if summary is not None else 1
    report_status(status)
    return status


STATUS_FILE_ENV = "MEGATHUNDER_STATUS_FILE"


def report_status(status: int) -> None:
    """Rank 0 writes the run's exit status to ``$MEGATHUNDER_STATUS_FILE`` (the launch scripts set it)
    before it exits. A launcher cannot always read it from its step: once rank 0 exits 75 (stopped
    after a step, checkpointed) srun's --kill-on-bad-exit terminates the ranks still exiting, and
    the step reports their 143 instead."""
    path = os.environ.get(STATUS_FILE_ENV)
    if path:
        Path(path).write_text(f"{status}\n")


async def _control(cfg: Config, task: Task, out: Path, service: LearnerService[LearnerEndpoint], model_dir: Path,
                   start: int, signals: StopSignals, extras: Extras, host: HostTuning,
                   flops: Utilisation | None) -> dict | int | None:
    loop, control = asyncio.get_running_loop(), asyncio.current_task()
    assert control is not None
    signals.on_stop_now.append(lambda: loop.call_soon_threadsafe(control.cancel))
    closed = threading.Event()

    def on_hang() -> None:  # the watchdog found a hung learner rank: close the engine, then it exits
        try:
            loop.call_soon_threadsafe(control.cancel)
        except RuntimeError:  # the loop has already ended
            return
        closed.wait()  # bounded by the watchdog (liveness.CLEANUP_S)

    service.on_hang = on_hang
    codec = make_codec(AutoTokenizer.from_pretrained(model_dir), cfg.agent.chat_template, cfg.agent.tool_parser)
    trainer: Trainer | None = None

    async def revive(engine: RolloutEngine) -> None:  # a dead engine core, started again in place
        if trainer is None:
            raise RuntimeError("the rollout engine died before training began")
        await trainer.revive_engine()  # the learner's weights (its senders join the new groups), then the probe

    host.pin_rollout()
    engine = await start_engine(cfg.rollout.engine, model_dir, log_dir=out / "logs", policy_version=start,
                                senders="learner", revive=revive)
    service.window.hold_while(host.generation_hold(engine.busy if isinstance(engine, InProcessEngine) else None))
    try:
        trainer = Trainer(cfg, out, LearnerClient(service), engine, codec, task, start, flops)
        if cfg.chaos.faults:
            Chaos(cfg.chaos.faults, out).install(trainer)  # wrappers around the trainer's parts
        if extras.install is not None:
            extras.install(trainer)
        await trainer.weights.connect()  # each stage's sender joins the engine's weight-transfer groups
        await trainer.push_weights()  # the engine samples from exactly the learner's weights
        if cfg.eval.every_n_steps and start == 0:  # the warm-started model, before RL
            before = await trainer.evaluate(-1, force=True)
            (out / "eval_before.json").write_text(json.dumps(before, indent=2) + "\n")
        steps = StepsUntilSignal(range(start, cfg.run.num_steps), signals.after_step)
        freeze_startup_heap()
        trainer.records.start_clock()  # wall_s from the first step; set-up reported apart (setup_s)
        trainer.records.show_progress(len(steps), f"{cfg.objective.kind}/{cfg.schedule.mode}", cfg.run.progress)
        await (extras.schedule or SCHEDULES[cfg.schedule.mode])(trainer, steps)
        trainer.records.close_progress()
        if trainer.version < cfg.run.num_steps:  # asked to stop after a step: checkpoint now, resume later
            path = await trainer.learner.checkpoint()
            saved = f"checkpoint {path}" if path else "no checkpoint: no optimizer step taken yet"
            print(f"megathunder: stopped after step {trainer.version} of {cfg.run.num_steps}; {saved}; "
                  "the same command resumes from it", file=sys.stderr, flush=True)
            return STOPPED_EARLY
        if steps:
            await trainer.learner.checkpoint()
        await trainer.learner.export(out / "final_model")  # a HF directory: eval, serve, distill
        trainer.records.timeline.write(out, service.spans, trainer.records.metrics.rows)  # the trace the summary's estimates replay
        summary = write_summary(out, trainer.records.metrics.rows, setup_s=trainer.records.setup_s,
                                extra=sandbox_server_counts())
        print_summary(summary, out)
        return summary
    finally:
        signals.closing()  # a stop-now request from here on waits for the close
        if trainer is not None:
            trainer.close()
        await engine.close()
        await close_sandbox_pools()  # sandbox servers: this controller's connections (the servers stay)
        closed.set()
