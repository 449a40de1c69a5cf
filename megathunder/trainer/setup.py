"""What a run starts from: its initial model, its learner, and OPD's teacher.

    model_dir = initial_model(cfg, task, out, pgs)       # the configured HF directory or a tiny model, then SFT
    learner   = build_learner(cfg, pgs, model_dir)        # Megatron learner with the run's ledger settings
    teacher   = build_teacher_model(cfg, task, out, pgs)  # OPD: the configured teacher, or one built here

Every rank calls each of these (they build models and run collectives); files are written by
global rank 0 and read by every rank after a barrier.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megathunder.config import Config, DistillObjective, TinyModelConfig
from megathunder.learner.learner import MegatronLearner
from megathunder.learner.parallel import ProcessGroups
from megathunder.models.tiny_hf import TinyModelSpec, save_tiny_qwen2
from megathunder.rollout.tasks.task import Task
from megathunder.trainer.sft import warm_start


def initial_model(cfg: Config, task: Task, out: Path, pgs: ProcessGroups) -> Path:
    """The HF directory the run starts from: the configured checkpoint, or a tiny model built here;
    then the SFT warm start (if any) from it."""
    if cfg.learner.model.hf_checkpoint is not None:
        source = Path(cfg.learner.model.hf_checkpoint)
    elif cfg.run.init_model == "tiny":
        source = tiny_model(out / "init_model", cfg.run.tiny_model, pgs)
    else:
        source = Path(cfg.run.init_model)
    if cfg.sft.num_steps == 0:
        return source
    return warm_start(cfg, task, pgs, source, out / "sft_model")


def tiny_model(out_dir: Path, sizes: TinyModelConfig, pgs: ProcessGroups) -> Path:
    """The tiny Qwen2 of ``sizes`` and its tokenizer, built once by rank 0."""
    if pgs.rank == 0 and not (out_dir / "model.safetensors").is_file():
        save_tiny_qwen2(out_dir, TinyModelSpec(**sizes.model_dump()))
    barrier()
    return out_dir


def build_learner(cfg: Config, pgs: ProcessGroups, model_dir: Path) -> MegatronLearner:
    """The run's learner, from the weights in ``model_dir``."""
    return MegatronLearner.build(cfg.learner, cfg.objective, pgs, cfg.ledger, hf_dir=model_dir,
                                 temperature=cfg.rollout.temperature)


def teacher_dir(cfg: Config, run_dir: Path) -> Path:
    """Where the run's OPD teacher is: the configured checkpoint or the one the run built."""
    given = _distill(cfg).teacher.hf_checkpoint
    return Path(given) if given is not None else run_dir / "teacher_model"


def build_teacher_model(cfg: Config, task: Task, run_dir: Path, pgs: ProcessGroups) -> Path:
    """The teacher's HF directory. Unless ``objective.teacher.hf_checkpoint`` is given, the run
    builds one (every rank takes part; done once per run directory): the default tiny model (the
    GRPO quickstart's) SFT-warm-started on the task's reference solutions -- a teacher that
    solves the task, with the student's tokenizer."""
    out = teacher_dir(cfg, run_dir)
    teacher = _distill(cfg).teacher
    if teacher.hf_checkpoint is not None:
        return out
    source = tiny_model(run_dir / "teacher_init", TinyModelConfig(), pgs)
    teacher_cfg = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"num_steps": teacher.sft_num_steps})})
    return warm_start(teacher_cfg, task, pgs, source, out, desc="teacher sft")


def _distill(cfg: Config) -> DistillObjective:
    if not isinstance(cfg.objective, DistillObjective):
        raise TypeError(f"objective.kind={cfg.objective.kind} has no teacher")
    return cfg.objective


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
