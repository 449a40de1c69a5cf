"""TRL's ``GRPOTrainer`` on a megathunder workload (run by ``megathunder bench peers`` in its own
process): ``python -m megathunder.bench.peer_trl SPEC.json``.

SPEC: ``config`` and ``overrides`` (the megathunder run's), ``model`` (an HF directory), ``steps``,
``out``. Writes ``out/trl.json``: each step's wall time (``on_step_begin`` to ``on_step_end``:
generation, reward, forward, backward and the optimizer step), mean reward, and the instance
ids its reward function saw (one list per step: each completion's prompt).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from megathunder.rollout.verifiers import Verdict


def _reward(outcome: float | Verdict) -> float:
    return float(outcome.reward if isinstance(outcome, Verdict) else outcome)


async def _verify_all(task, instances: list, texts: list[str]) -> list[float]:
    """The task's own verifier on each completion's text, in one event loop for the whole batch."""
    outcomes = await asyncio.gather(*(task.verify(inst, cast(Any, SimpleNamespace(final_text=t)), None)
                                      for inst, t in zip(instances, texts)))
    return [_reward(o) for o in outcomes]


def main(spec_path: str) -> int:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megathunder.bench.peers import trl_arguments
    from megathunder.config import load_config
    from megathunder.rollout.tasks import build_task
    from megathunder.rollout.tasks.split import step_instances

    spec = json.loads(Path(spec_path).read_text())
    cfg = load_config(spec["config"], spec["overrides"])
    task = build_task(cfg.task)
    out = Path(spec["out"])

    # step s's prompts are rows [s*P, (s+1)*P): TRL's sampler takes them in order (shuffle_dataset=False)
    instances = [inst for s in range(spec["steps"]) for inst in step_instances(cfg, task, s)]
    by_id = {inst.instance_id: inst for inst in instances}
    data = Dataset.from_list([{"prompt": task.messages(inst), "instance": inst.instance_id} for inst in instances])

    def reward(prompts, completions, instance, completion_ids, **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        clock.instances.append(list(instance))
        rewards = asyncio.run(_verify_all(task, [by_id[i] for i in instance], texts))
        if cfg.verifier.truncated_reward is None:
            return rewards
        # as megathunder's agent loop: a completion cut at the token limit (no end token) gets that reward
        cut = [len(ids) >= cfg.agent.max_new_tokens_per_turn and ids[-1] != tokenizer.eos_token_id
               for ids in completion_ids]
        return [cfg.verifier.truncated_reward if c else r for c, r in zip(cut, rewards)]

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.reward_mean: list[float] = []
            self.instances: list[list[str]] = []  # per reward call (one per step): each completion's prompt
            self._t0 = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.step_s.append(time.perf_counter() - self._t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.reward_mean.append(float(logs["reward"]))

    clock = Clock()
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    args = GRPOConfig(output_dir=str(out / "trl_output"), max_steps=spec["steps"], use_cpu=not torch.cuda.is_available(),
                      **trl_arguments(cfg))
    # loaded here, not by name: TRL resolves a name through config.architectures, which a model
    # imported from GGUF (megathunder import-gguf) does not record
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    (out / "trl.json").write_text(json.dumps({"step_s": clock.step_s, "reward_mean": clock.reward_mean,
                                                  "instances": clock.instances}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
