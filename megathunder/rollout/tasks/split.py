"""The split of a task's instances into training and held-out evaluation material.

Generated tasks draw instances from a seed, and different seeds can produce the same problem (the
arithmetic task has only 2 * (max_operand + 1)^2 of them), so a separate seed range does not make
an evaluation set disjoint from training. The split is by content instead: an instance is held
out when a hash of its prompt falls below ``eval.heldout_fraction``. Training excludes the
held-out instances with :func:`is_held_out` (or draws with :func:`draw_instances` and
``held_out=False``), so no prompt is ever in both, whatever seeds either side uses.

``eval.split = "all"`` skips the split: every instance of the task is evaluation material (a
separate test file given as ``task.path``).
"""

from __future__ import annotations

import hashlib

from megathunder.config import Config
from megathunder.rollout.tasks.task import Task, TaskInstance


class InstanceDrawError(ValueError):
    """A draw that cannot give the instances asked for (too few distinct ones)."""


def is_held_out(inst: TaskInstance, heldout_fraction: float) -> bool:
    """True when ``inst`` belongs to the evaluation split (a fixed function of its prompt)."""
    digest = hashlib.sha256(inst.prompt.encode()).digest()
    return int.from_bytes(digest[:8], "big") < heldout_fraction * 2**64


def draw_instances(
    task: Task,
    num: int,
    seed: int,
    *,
    held_out: bool | None,
    heldout_fraction: float = 0.1,
    batch: int = 16,
    max_stale_draws: int = 64,
) -> list[TaskInstance]:
    """``num`` distinct instances (by prompt) of one split, reproducible from ``seed``.

    ``held_out``: True for the evaluation split, False for training, None for no split. Draws
    ``task.instances(batch, seed=s)`` for s = seed, seed + 1, ... and raises
    :class:`InstanceDrawError` when ``max_stale_draws`` draws in a row bring no unseen prompt (the
    task has run out): a result is never computed on fewer distinct instances than asked for.
    """
    if num < 1:
        raise InstanceDrawError(f"num_instances must be >= 1, got {num}")
    out: list[TaskInstance] = []
    seen: set[str] = set()
    stale, s = 0, seed
    while len(out) < num:
        new = 0
        for inst in task.instances(batch, seed=s):
            if inst.prompt in seen:
                continue
            seen.add(inst.prompt)
            new += 1
            if held_out is None or is_held_out(inst, heldout_fraction) == held_out:
                out.append(inst)
                if len(out) == num:
                    break
        s += 1
        stale = 0 if new else stale + 1
        if stale >= max_stale_draws:
            which = {None: "", True: "held-out ", False: "training "}[held_out]
            raise InstanceDrawError(
                f"eval.num_instances: task {task.name} has only {len(out)} distinct {which}"
                f"instances ({len(seen)} seen in all), fewer than the {num} asked for"
            )
    return out


def training_instances(cfg: Config, task: Task, num: int, seed: int) -> list[TaskInstance]:
    """``num`` distinct training instances drawn from ``seed``, never one of the held-out split
    (for the trainer: vary ``seed`` per batch)."""
    ev = cfg.eval
    held_out = False if ev.split == "held_out" else None
    return draw_instances(task, num, seed, held_out=held_out, heldout_fraction=ev.heldout_fraction)


def step_instances(cfg: Config, task: Task, step: int, num: int | None = None) -> list[TaskInstance]:
    """Training step ``step``'s prompts (``num``, default ``batch.num_prompts_per_batch``): the
    trainer's draw, also used by ``megathunder bench peers`` to give a peer the same prompts."""
    return training_instances(cfg, task, num or cfg.batch.num_prompts_per_batch,
                              seed=cfg.run.seed * 1_000_003 + step)
