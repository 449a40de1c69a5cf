"""Replay a run from its journal: the same trajectories, rewards and event order, through any
schedule's gradient path, from the run's initial weights.

``thunder`` feeds each step's finish and reward events to the gradient ledger in the order they
happened (OPD: each trajectory's turns, recovered from its loss mask, right before its finish
event); every other schedule computes the batch-synchronous gradient of the step's batch
(async and fully_async differ from sync only in *which* data a step gets, and that is what the
journal recorded). Same journal, same parameters: ``tests/distributed`` replays one journal
through sync and thunder on 1 process and on TP = 2 / DP = 2 and compares the weights.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import yaml

from megathunder.config import Config, load_config
from megathunder.learner.batches import new_batch
from megathunder.learner.learner import MegatronLearner
from megathunder.learner.parallel import init_distributed
from megathunder.learner.safetensors_io import load_dir
from megathunder.learner.teacher import build_teacher
from megathunder.streaming.opd_turns import CachedTeacher
from megathunder.trainer.journal import completed_steps
from megathunder.trainer.setup import build_learner, teacher_dir
from megathunder.trajectory import batch_plan, turn_spans


def replay(cfg: Config, run_dir: Path, learner: MegatronLearner, num_steps: int | None = None,
           teacher: CachedTeacher | None = None) -> int:
    """Apply the journal's steps (all, or the first ``num_steps``) to ``learner``; returns how many.
    ``teacher``: OPD's (``objective.kind: opd`` or ``opd_grpo``)."""
    streamed = cfg.schedule.mode == "thunder"
    turns = teacher is not None or (streamed and cfg.ledger.per_turn_scores != "off")  # the run streamed turns
    done = 0
    for step, entries, _ in completed_steps(run_dir / "journal.jsonl"):
        if num_steps is not None and done >= num_steps:
            break
        if step < learner.num_steps:
            continue  # already in the learner's (resumed) weights
        batch = new_batch(learner, teacher, batch_plan(e.traj for e in entries), streamed)
        events = [(e.t_finished, 0, "finished", e) for e in entries] + [(e.t_reward, 1, "reward", e) for e in entries]
        for _, _, kind, e in sorted(events, key=lambda ev: (ev[0], ev[1], ev[3].traj.traj_id)):
            if kind == "finished":
                if turns:
                    tokens, engine = e.traj.tokens.tolist(), e.traj.rollout_logprobs
                    for start, end in turn_spans(e.traj):
                        logprobs = None if engine is None else engine[start - 1 : end - 1].tolist()
                        batch.on_turn(e.traj.traj_id, tokens[:end], start, end, logprobs)
                batch.on_finished(e.traj)
            else:
                batch.on_reward(e.traj.traj_id, e.reward)
        batch.close()
        learner.step()
        done += 1
    return done


def initial_weights(run_dir: Path) -> Path:
    """The HF directory the run started from (after its warm start)."""
    for name in ("sft_model", "init_model"):
        if (run_dir / name / "config.json").is_file():
            return run_dir / name
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    return Path(cfg["learner"]["model"]["hf_checkpoint"])


def build_replay_learner(cfg: Config, run_dir: Path) -> MegatronLearner:
    return build_learner(cfg, init_distributed(cfg.learner), initial_weights(run_dir))


def digest(path: Path) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(load_dir(path).items()):
        h.update(name.encode())
        h.update(tensor.to(torch.float32).numpy().tobytes())
    return h.hexdigest()[:16]


def main(run_dir: str | Path, overrides: list[str], out: str) -> int:
    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml", overrides)
    learner = build_replay_learner(cfg, run_dir)
    teacher = None
    if cfg.objective.needs_teacher:
        teacher = build_teacher(teacher_dir(cfg, run_dir), learner.cfg, learner.pgs)
    n = replay(cfg, run_dir, learner, teacher=teacher)
    learner.export_hf(out)
    if learner.pgs.rank == 0:
        print(json.dumps({"replayed_steps": n, "schedule": cfg.schedule.mode, "out": out,
                          "digest": digest(Path(out))}))
    return 0
