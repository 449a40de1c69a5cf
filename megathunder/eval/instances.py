"""The evaluation instances of a run (the held-out split: ``megathunder.rollout.tasks.split``),
and when periodic evaluation is due."""

from __future__ import annotations

from megathunder.config import Config
from megathunder.rollout.tasks.split import draw_instances
from megathunder.rollout.tasks.task import Task, TaskInstance


class EvalInputError(ValueError):
    """Evaluation inputs that cannot give the result asked for (a bad checkpoint path)."""


def eval_instances(cfg: Config, task: Task) -> list[TaskInstance]:
    """The evaluation instances of a :class:`megathunder.config.Config` (``cfg.eval``)."""
    ev = cfg.eval
    held_out = None if ev.split == "all" else True
    return draw_instances(
        task, ev.num_instances, ev.seed, held_out=held_out, heldout_fraction=ev.heldout_fraction
    )


def eval_due(cfg: Config, step: int) -> bool:
    """Whether periodic evaluation runs after optimizer step ``step`` (``eval.every_n_steps``)."""
    every = cfg.eval.every_n_steps
    return every > 0 and step % every == 0
