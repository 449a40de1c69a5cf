"""``megathunder train``: set up a run (or resume it), train, and write its report.

    groups   = init_distributed(cfg.learner)                # TP x PP x DP, gloo or NCCL
    model    = initial_model(cfg, out) -> sft warm start    # HF directory: learner and vLLM load it
    learner  = MegatronLearner.build(...); resume from checkpoints/latest
    teacher  = objective.kind=opd/opd_grpo: frozen Megatron model (given, or built: tiny model + SFT)
    rank 0:  engine, agent loop -> Trainer -> SCHEDULES[cfg.schedule.mode]
    others:  LearnerService.serve()
    rank 0:  timeline.png / trace.json, summary.json, checkpoint

SIGUSR1 (Slurm's ``--signal=B:USR1@T`` forwarded by the launch script) ends the step loop after
the current step; rank 0 saves a checkpoint and the command exits with STOPPED_EARLY (75), so the
script can requeue the job and the same command resumes from checkpoints/latest.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import threading
from pathlib import Path

import torch.distributed as dist
import yaml
from tqdm import tqdm

from megathunder.config import Config

log = logging.getLogger(__name__)

STOPPED_EARLY = 75  # exit status: stopped on SIGUSR1 with a checkpoint saved; run again to resume


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


def initial_model(cfg: Config, out: Path, groups) -> Path:
    """The HF directory the run starts from: the configured checkpoint, or a tiny model built here;
    then the SFT warm start (if any) from it."""
    from megathunder.trainer.sft import warm_start

    if cfg.learner.model.hf_checkpoint is not None:
        source = Path(cfg.learner.model.hf_checkpoint)
        if not (source / "config.json").is_file():
            raise FileNotFoundError(f"learner.model.hf_checkpoint: {source} has no config.json")
    elif cfg.run.init_model == "tiny":
        source = tiny_model(out / "init_model", cfg.run.tiny_model, groups)
    else:
        source = Path(cfg.run.init_model)
    if cfg.sft.num_steps == 0:
        return source
    return warm_start(cfg, groups, source, out / "sft_model")


def tiny_model(out_dir: Path, sizes, groups) -> Path:
    """The tiny Qwen2 of ``sizes`` (a ``TinyModelConfig``) and its tokenizer, built once by rank 0."""
    if groups.rank == 0 and not (out_dir / "model.safetensors").is_file():
        from megathunder.models.tiny_hf import TinyModelSpec, save_tiny_qwen2

        save_tiny_qwen2(out_dir, TinyModelSpec(**sizes.model_dump()))
    _barrier()
    return out_dir


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def prepare_run_dir(cfg: Config) -> Path:
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def train(cfg: Config) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the progress bar is the run's output
    from megathunder.learner.checkpoint import latest_checkpoint, load_checkpoint
    from megathunder.learner.learner import MegatronLearner
    from megathunder.learner.parallel import init_distributed
    from megathunder.learner.service import LearnerService
    from megathunder.trainer.trainer import learner_handlers

    stop_requested = threading.Event()  # every rank: SIGUSR1's default action would kill the process
    signal.signal(signal.SIGUSR1, lambda signum, frame: stop_requested.set())
    out = prepare_run_dir(cfg)
    groups = init_distributed(cfg.learner)
    ckpt_dir = out / "checkpoints"
    latest = latest_checkpoint(ckpt_dir) if cfg.run.resume else None
    if groups.rank == 0:
        if latest is None:  # a fresh run: nothing of an earlier one may be mixed in
            for name in ("journal.jsonl", "metrics.jsonl", ".wandb_id"):
                (out / name).unlink(missing_ok=True)
            for name in ("checkpoints", "wandb"):
                shutil.rmtree(out / name, ignore_errors=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    _barrier()
    model_dir = initial_model(cfg, out, groups)
    learner_cfg = cfg.learner.model_copy(deep=True)
    learner_cfg.model.hf_checkpoint = str(model_dir)
    ledger_cfg = cfg.ledger
    if cfg.verifier.on_failure == "drop_group":
        ledger_cfg = ledger_cfg.model_copy(update={"hold_groups_until_close": True})
    learner = MegatronLearner.build(learner_cfg, cfg.objective, groups, ledger_cfg)
    teacher = None
    if cfg.objective.kind in ("opd", "opd_grpo"):  # a frozen Megatron teacher in the student's layout
        from megathunder.learner.segment_model import build_teacher
        from megathunder.trainer.opd import build_teacher_model

        teacher = build_teacher(build_teacher_model(cfg, out, groups), learner_cfg, groups)
    if latest is not None:
        load_checkpoint(learner, latest)
        if groups.rank == 0:
            print(f"megathunder: resumed from {latest} (step {learner.num_steps})", flush=True)
    start = learner.num_steps
    service = LearnerService(learner_handlers(learner, ckpt_dir, teacher), groups.rank, groups.world_size)
    if groups.rank != 0:
        service.serve()
        return 0
    try:
        summary = asyncio.run(_control(cfg, out, service, model_dir, start, stop_requested))
    finally:
        service.stop()
    if summary == STOPPED_EARLY:
        return STOPPED_EARLY
    return 0 if summary is not None else 1


async def _control(cfg: Config, out: Path, service, model_dir: Path, start: int, stop_requested: threading.Event):
    from transformers import AutoTokenizer

    from megathunder.rollout.agent_loop import build_agent_loop
    from megathunder.rollout.chat import ChatCodec
    from megathunder.rollout.engines import start_engine
    from megathunder.rollout.tasks import build_task
    from megathunder.trainer.schedules import SCHEDULES
    from megathunder.trainer.timeline import write_timeline
    from megathunder.trainer.trainer import Trainer, print_summary, write_summary

    codec = ChatCodec(AutoTokenizer.from_pretrained(model_dir))
    engine = await start_engine(cfg.rollout.engine, model_dir, log_dir=out / "logs", policy_version=start)
    trainer = None
    try:
        agent_loop = build_agent_loop(cfg, engine, codec)
        trainer = Trainer(cfg, out, service, engine, codec, agent_loop, build_task(cfg.task), start)
        await trainer.push_weights()  # the engine samples from exactly the learner's weights
        if cfg.eval.every_n_steps and start == 0:  # the warm-started model, before RL
            before = await trainer.periodic_eval(-1, force=True)
            (out / "eval_before.json").write_text(json.dumps(before, indent=2) + "\n")
        steps = StepsUntilSignal(range(start, cfg.run.num_steps), stop_requested)
        trainer.bar = tqdm(total=len(steps), desc=f"{cfg.objective.kind}/{cfg.schedule.mode}", unit="step",
                           disable=not cfg.run.progress, mininterval=1.0)
        await SCHEDULES[cfg.schedule.mode](trainer, steps)
        trainer.bar.close()
        if trainer.version < cfg.run.num_steps:  # SIGUSR1: checkpoint now, resume later
            path = await service.call("checkpoint")
            print(f"megathunder: SIGUSR1: stopped after step {trainer.version} of {cfg.run.num_steps}; "
                  f"checkpoint {path}; the same command resumes from it", flush=True)
            return STOPPED_EARLY
        if steps:
            await service.call("checkpoint")
        await service.call("export", str(out / "final_model"))  # a HF directory: eval, serve, distill
        summary = write_summary(out, trainer.metrics.rows)
        if (out / "eval_before.json").is_file():
            before = json.loads((out / "eval_before.json").read_text())
            if "eval/pass@1" in before:
                summary = {**summary, "eval_pass@1_before_rl": round(before["eval/pass@1"], 4)}
        write_timeline(out, trainer)
        print_summary(summary, out)
        return summary
    finally:
        if trainer is not None:
            trainer.metrics.close()
            trainer.journal.close()
        await engine.close()
