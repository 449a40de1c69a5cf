"""Supervised warm start: the task's reference solutions, trained on the Megatron learner.

The demonstrations are real episodes: the scripted policy plays each instance's reference turns
through the same agent loop (chat template, tool calls run in the sandbox, tool outputs masked),
so the tokens the warm start trains on are laid out exactly as RL trajectories are. The loss is
token-mean cross-entropy over the trained (model-written) targets of each batch. The result is
exported as a Hugging Face directory, which both the RL learner and vLLM start from.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoTokenizer

from megathunder.config import Config, GRPOObjective
from megathunder.learner.batches import sft_gradient
from megathunder.learner.learner import MegatronLearner
from megathunder.learner.parallel import ProcessGroups
from megathunder.learner.safetensors_io import has_weights
from megathunder.rollout.agent_loop import build_agent_loop
from megathunder.rollout.chat import ChatCodec
from megathunder.rollout.chat_template import make_codec
from megathunder.rollout.sandbox import close_sandbox_pools
from megathunder.rollout.scripted import ScriptedPolicy
from megathunder.rollout.tasks.split import is_held_out
from megathunder.rollout.tasks.task import Task
from megathunder.trajectory import Trajectory


async def demonstrations(cfg: Config, task: Task, codec: ChatCodec, num: int, seed: int) -> list[Trajectory]:
    """``num`` reference episodes of ``task`` (instances drawn with ``seed``)."""
    instances = task.instances(num, seed=seed)
    if cfg.eval.split == "held_out":  # never train on what evaluation measures
        instances = [i for i in instances if not is_held_out(i, cfg.eval.heldout_fraction)]
    policy = ScriptedPolicy(codec, {inst.prompt: list(task.scripted_turns(inst)) for inst in instances})
    loop = build_agent_loop(cfg, policy, codec, task)
    try:
        episodes = await loop.run_batch(instances, 1)
    finally:
        await close_sandbox_pools()  # this loop's connections to sandbox servers, if any
    return [ep.to_trajectory() for ep in episodes]


def warm_start(cfg: Config, task: Task, pgs: ProcessGroups, source: Path, out_dir: Path,
               desc: str = "sft warm start") -> Path:
    """Train ``sft.num_steps`` steps on ``task``'s reference solutions from the HF directory
    ``source``; export to ``out_dir``."""
    if (out_dir / "config.json").is_file() and has_weights(out_dir):
        return out_dir  # a resumed run: the warm start is done
    sft = cfg.sft
    learner_cfg = cfg.learner.model_copy(update={"optimizer": sft.optimizer(cfg.learner.optimizer)})
    learner = MegatronLearner.build(learner_cfg, GRPOObjective(), pgs, hf_dir=source)
    codec = make_codec(AutoTokenizer.from_pretrained(source), cfg.agent.chat_template, cfg.agent.tool_parser)
    data = asyncio.run(demonstrations(cfg, task, codec, sft.num_steps * sft.batch_size, seed=cfg.run.seed + 7919))
    random.Random(cfg.run.seed).shuffle(data)
    data = data * -(-sft.num_steps * sft.batch_size // len(data))  # held-out instances were left out
    show = cfg.run.progress and pgs.rank == 0
    bar = tqdm(range(sft.num_steps), desc=desc, unit="step", disable=not show, mininterval=1.0)
    for step in bar:
        loss = sft_gradient(learner, data[step * sft.batch_size : (step + 1) * sft.batch_size])
        learner.step()
        bar.set_postfix(loss=f"{loss:.3f}")
    learner.export_hf(out_dir)
    if dist.is_initialized():
        dist.barrier()
    return out_dir
