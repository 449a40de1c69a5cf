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
import gc
import json
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import yaml
from tqdm import tqdm
from transformers import AutoTokenizer

from megathunder import cpu_cores
from megathunder.config import Config, ConfigError
from megathunder.learner import cpu_compat
from megathunder.learner.checkpoint import latest_checkpoint, load_checkpoint
from megathunder.learner.endpoint import LearnerEndpoint
from megathunder.learner.parallel import init_distributed
from megathunder.learner.service import LearnerService
from megathunder.learner.teacher import build_teacher
from megathunder.rollout.chat_template import make_codec
from megathunder.rollout.engines import start_engine
from megathunder.rollout.engines.inprocess import InProcessEngine
from megathunder.rollout.engines.transfer import StageSenders
from megathunder.rollout.tasks import build_task
from megathunder.rollout.tasks.task import Task
from megathunder.rollout.tasks.task_check import check_before_training
from megathunder.trainer.chaos import ChaosStop, check_learner_faults
from megathunder.trainer.interrupt import STOPPED_EARLY, STOPPED_NOW, StopNow, StopSignals
from megathunder.trainer.schedules import SCHEDULES
from megathunder.trainer.setup import barrier, build_learner, build_teacher_model, initial_model
from megathunder.trainer.summary import print_summary, write_summary
from megathunder.trainer.trainer import Trainer

log = logging.getLogger(__name__)

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


def train(cfg: Config) -> int:
    signals = StopSignals()  # every rank: SIGUSR1's default action would kill the process
    try:
        return _train(cfg, signals)
    except ChaosStop as err:  # chaos.faults: a crash, as injected
        print(f"megathunder: {err}", file=sys.stderr, flush=True)
        return STOPPED_NOW
    except (StopNow, asyncio.CancelledError):
        if signals.now.is_set():
            print(f"megathunder: stopped now; the same command resumes from the last checkpoint in "
                  f"{Path(cfg.run.output_dir) / 'checkpoints'} (if any)", file=sys.stderr, flush=True)
            return STOPPED_NOW
        raise


def _train(cfg: Config, signals: StopSignals) -> int:
    learner_cores, rollout_cores = cfg.learner.cpu_cores, cfg.rollout.engine.cpu_cores
    try:  # on the machine itself (a config may be written elsewhere), before anything starts
        cpu_cores.check_available("learner.cpu_cores", learner_cores)
        cpu_cores.check_available("rollout.engine.cpu_cores", rollout_cores)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if learner_cores is not None:
        learner_cores = cpu_cores.share(learner_cores, *cpu_cores.local_rank())
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
                             pack_window_s=cfg.ledger.pack_window_s, cpu_cores=learner_cores)
    if pgs.rank != 0:
        cpu_cores.pin_this_thread(learner_cores, threads=True)  # a follower computes on its main thread
        freeze_startup_heap()
        service.serve()
        gc.unfreeze()
        return 0
    try:
        # rank 0's Megatron work runs on the service's learner thread (its own CUDA->CPU mapping); the
        # controller's torch calls (episodes into trajectories, 160 a step on the quickstart) skip it
        with cpu_compat.suspended():
            summary = asyncio.run(_control(cfg, task, out, service, model_dir, start, signals))
    finally:
        service.stop(cancel_pending=signals.now.is_set())
        gc.unfreeze()  # the interpreter's last collection then frees the frozen cycles
    status = STOPPED_EARLY if summary == STOPPED_EARLY else 0 if summary is not None else 1
    report_status(status)
    return status


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (torch, Megatron, vLLM's client, transformers: ~0.8M
    objects on the quickstart) out of the garbage collector's sight. Its full collections scan
    them all, 0.3-0.6 s with the GIL held, which stalls the learner thread and the rollout alike:
    on the quickstart one such pause in a 6-step run made a 0.35 s step 0.9 s (BENCHMARKS.md).
    Frozen objects are still freed by reference counting; only cycles among them are not -- until
    ``gc.unfreeze()`` at the run's end, without which triton's bindings (installed with vLLM, imported
    by torch's dynamo) print "nanobind: leaked ..." for their cycles as the interpreter exits."""
    gc.collect()
    gc.freeze()


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
                   start: int, signals: StopSignals) -> dict | int | None:
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
    senders = StageSenders(cfg.learner.parallel.pipeline_parallel,  # each stage joins the weight-transfer groups
                           lambda rdv: service.call(LearnerEndpoint.join_weight_transfer, rdv))
    cpu_cores.pin_this_thread(cfg.rollout.engine.cpu_cores)  # the rollout's side; the engine's processes inherit it
    engine = await start_engine(cfg.rollout.engine, model_dir, log_dir=out / "logs", policy_version=start,
                                senders=senders)
    own_cores = cfg.learner.cpu_cores is not None and cfg.rollout.engine.cpu_cores is not None  # disjoint
    if isinstance(engine, InProcessEngine) and cfg.ledger.hold_while_generating == "in_process" and not own_cores:
        service.generating = engine.generating  # it generates on the learner's own cores or devices
    trainer = None
    try:
        trainer = Trainer(cfg, out, service, engine, codec, task, start)
        await trainer.push_weights()  # the engine samples from exactly the learner's weights
        if cfg.eval.every_n_steps and start == 0:  # the warm-started model, before RL
            before = await trainer.periodic_eval(-1, force=True)
            (out / "eval_before.json").write_text(json.dumps(before, indent=2) + "\n")
        steps = StepsUntilSignal(range(start, cfg.run.num_steps), signals.after_step)
        freeze_startup_heap()
        trainer.bar = tqdm(total=len(steps), desc=f"{cfg.objective.kind}/{cfg.schedule.mode}", unit="step",
                           disable=not cfg.run.progress, mininterval=1.0)
        await SCHEDULES[cfg.schedule.mode](trainer, steps)
        trainer.bar.close()
        if trainer.version < cfg.run.num_steps:  # asked to stop after a step: checkpoint now, resume later
            path = await service.call(LearnerEndpoint.checkpoint)
            print(f"megathunder: stopped after step {trainer.version} of {cfg.run.num_steps}; checkpoint {path}; "
                  "the same command resumes from it", file=sys.stderr, flush=True)
            return STOPPED_EARLY
        if steps:
            await service.call(LearnerEndpoint.checkpoint)
        await service.call(LearnerEndpoint.export, str(out / "final_model"))  # a HF directory: eval, serve, distill
        trainer.timeline.write(out, service.spans, trainer.metrics.rows)  # the trace the summary's estimates replay
        summary = write_summary(out, trainer.metrics.rows)
        if (out / "eval_before.json").is_file():
            before = json.loads((out / "eval_before.json").read_text())
            if "eval/pass@1" in before:
                summary = {**summary, "eval_pass@1_before_rl": round(before["eval/pass@1"], 4)}
        print_summary(summary, out)
        return summary
    finally:
        signals.closing()  # a stop-now request from here on waits for the close
        if trainer is not None:
            trainer.abandon_probe()
            if trainer.bar is not None:
                trainer.bar.close()
            trainer.metrics.close()
            trainer.journal.close()
        await engine.close()
        closed.set()
