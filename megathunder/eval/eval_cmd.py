"""``megathunder eval``: pass@1..k of a Hugging Face checkpoint on the task's evaluation instances.

Order matters for bad input: the config, the checkpoint directory and the task's instances are all
checked before the (slow) engine starts, and each failure is one line naming what is wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from megathunder.config import Config, load_config
from megathunder.eval.evaluate import EvalResult, MissingSamplesError, evaluate
from megathunder.eval.instances import EvalInputError, eval_instances
from megathunder.rollout import engines
from megathunder.rollout.chat_template import make_codec
from megathunder.rollout.sandbox import close_sandbox_pools
from megathunder.rollout.tasks import build_task
from megathunder.rollout.tasks.datasets import DatasetError
from megathunder.rollout.tasks.split import InstanceDrawError
from megathunder.rollout.tasks.task import Task, TaskInstance


def check_checkpoint(path: str | Path) -> Path:
    """A Hugging Face model directory: exists, with config.json and tokenizer.json."""
    path = Path(path)
    if not path.is_dir():
        raise EvalInputError(f"--checkpoint {path}: no such directory")
    for name in ("config.json", "tokenizer.json"):
        if not (path / name).is_file():
            raise EvalInputError(
                f"--checkpoint {path}: no {name} (expected a Hugging Face model directory)"
            )
    return path


def format_table(result: EvalResult, task_name: str) -> str:
    lines = [f"evaluation: {task_name}, {result.num_instances} instances x {result.k} samples"]
    try:
        scores = result.pass_at_all()
    except MissingSamplesError as err:  # said instead of a score
        lines.append(f"  no scores: {err}")
        scores = {}
    lines.append(f"  {'metric':<24} {'value':>10} {'stderr':>10}")
    for j, (mean, se) in scores.items():
        se_text = "-" if math.isnan(se) else f"{se:.4f}"
        lines.append(f"  {f'pass@{j}':<24} {mean:>10.4f} {se_text:>10}")
    cost = result.cost()
    rows = [
        ("instances failed", result.num_failed),
        ("verifier failures", result.num_samples_with("verifier_error", "verifier_timeout")),
        ("missing samples", result.num_samples_with("episode_error")),
        ("generated tokens", cost["num_generated_tokens"]),
        ("prompt tokens", cost["num_prompt_tokens"]),
        ("tool calls (errors)", f"{cost['num_tool_calls']} ({cost['num_tool_errors']})"),
        ("generation s (sum)", f"{cost['generation_s']:.1f}"),
        ("tool s (sum)", f"{cost['tool_s']:.1f}"),
        ("verifier s (sum)", f"{cost['verifier_s']:.1f}"),
        ("wall s", f"{cost['wall_s']:.1f}"),
    ]
    lines += [f"  {name:<24} {value!s:>10}" for name, value in rows]
    return "\n".join(lines)


def _log_wandb(cfg: Config, result: EvalResult, out_dir: Path) -> str | None:
    """Offline wandb run with the metrics, when wandb is installed (never online: evaluation of
    a checkpoint is logged locally; ``run.wandb=disabled`` or --no-wandb skip it)."""
    try:
        import wandb
    except ImportError:
        return None
    run = wandb.init(
        mode="offline", project="megathunder", job_type="eval", dir=str(out_dir),
        config=cfg.model_dump(mode="json"),
    )  # fmt: skip
    try:
        run.log(result.metrics())
    finally:
        run.finish()
    return str(getattr(run, "dir", out_dir))


async def _run_engine(cfg: Config, checkpoint: Path, task: Task, instances: Sequence[TaskInstance]) -> EvalResult:
    from transformers import AutoTokenizer

    codec = make_codec(AutoTokenizer.from_pretrained(checkpoint), cfg.agent.chat_template, cfg.agent.tool_parser)
    engine = await engines.start_engine(cfg.rollout.engine, checkpoint, log_dir=cfg.run.output_dir)
    try:
        return await evaluate(cfg, engine, codec, task, instances, progress=True)
    finally:
        await engine.close()
        await close_sandbox_pools()


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    try:
        checkpoint = check_checkpoint(args.checkpoint)
        task = build_task(cfg.task)
        instances = eval_instances(cfg, task)
    except (EvalInputError, InstanceDrawError, DatasetError) as err:
        print(f"megathunder eval: {err}", file=sys.stderr)
        return 2

    result = asyncio.run(_run_engine(cfg, checkpoint, task, instances))

    out_path = Path(args.out or cfg.eval.output_path or Path(cfg.run.output_dir) / "eval.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    record = {"checkpoint": str(checkpoint), "task": cfg.task.name, **result.to_json()}
    out_path.write_text(json.dumps(record, indent=1) + "\n")
    print(format_table(result, cfg.task.name))
    print(f"wrote {out_path}")
    if not args.no_wandb and cfg.run.wandb != "disabled" and record["error"] is None:
        where = _log_wandb(cfg, result, out_path.parent)
        if where:
            print(f"wandb (offline): {where}")
    summary = {k: v for k, v in record.items() if k != "instances"}
    print(json.dumps(summary))
    return 0 if record["error"] is None else 1
