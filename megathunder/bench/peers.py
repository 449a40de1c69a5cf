"""Sync and thunder beside the simplest peer, TRL's GRPOTrainer, on the same workload.

``megathunder bench peers`` runs the three one after the other in one invocation.

Same model (the run's own warm-started model, or ``learner.model.hf_checkpoint``), the same prompts
at every step (the trainer's draw, ``step_instances``), samples per prompt, completion length,
temperature, optimizer (Adam/AdamW, lr, betas, eps, weight decay, grad-norm clip, constant rate),
advantage and loss aggregation, KL coefficient, and the task's own verifier as TRL's reward function.
TRL runs as its documented users run it on one machine: HF ``generate`` (no vLLM), the whole batch
of ``prompts x samples`` completions in one optimizer step (no gradient accumulation), fp32, no
gradient checkpointing. TRL comes from PyPI through the ``peers`` extra
(``pip install -e '.[peers]'``) and runs in its own process (``megathunder.bench.peer_trl``).

Reported per system: the median step time over the steps after the first (the first step of every
system pays one-off costs: compilation, allocator warm-up, vLLM's first batch), and the mean reward
per step, side by side. What is not the same, and cannot be: megathunder's step includes pushing the
weights into vLLM and the zero-staleness probe; TRL generates from the model it trains.

``--rounds N`` runs the three N times, every other round in reverse order, and reports each ratio to
TRL as the median of its per-round ratios (one invocation's ratio moves by several points on a
shared machine).

Only single-turn tasks without tools compare like this (TRL's trainer has no sandboxed agent loop):
the task's reward must be computable from the completion's text alone (``arithmetic``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from megathunder.bench.schedule_runs import ROOT, _train, alternate, median_after_first, positive, step_rows
from megathunder.config import Config, ConfigError, load_config
from megathunder.config.objective_config import GRPOObjective

SYSTEMS = ("sync", "thunder", "trl")

# megathunder's advantage -> TRL's reward scaling (both subtract the group mean first)
_SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none", "batch_std": "batch"}
# megathunder's loss aggregation -> TRL's loss_type
_LOSS_TYPE = {"token_mean": "dapo", "seq_mean_token_mean": "grpo"}


def trl_arguments(cfg: Config) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments for the workload ``cfg`` describes, or ``ConfigError``
    naming the field TRL cannot match."""
    obj, opt, agent = cfg.objective, cfg.learner.optimizer, cfg.agent
    if not isinstance(obj, GRPOObjective):
        raise ConfigError(f"objective.kind: bench peers compares GRPO runs; got {obj.kind!r}")
    if cfg.task.name != "arithmetic" or agent.max_turns != 1:
        raise ConfigError("task.name: bench peers compares single-turn tasks whose reward reads the "
                          f"completion's text alone (arithmetic, agent.max_turns=1); got {cfg.task.name!r} "
                          f"with agent.max_turns={agent.max_turns}")
    if obj.advantage not in _SCALE_REWARDS:
        raise ConfigError(f"objective.advantage: TRL has no {obj.advantage!r}; one of {sorted(_SCALE_REWARDS)}")
    if obj.loss_agg not in _LOSS_TYPE:
        raise ConfigError(f"objective.loss_agg: TRL has no {obj.loss_agg!r}; one of {sorted(_LOSS_TYPE)}")
    if obj.entropy_coef > 0:
        raise ConfigError("objective.entropy_coef: TRL's entropy term is not megathunder's; set it to 0")
    if opt.name != "adam":
        raise ConfigError(f"learner.optimizer.name: TRL trains with AdamW here; got {opt.name!r}")
    if opt.lr_decay_style != "constant" or opt.lr_warmup_steps:
        raise ConfigError("learner.optimizer.lr_decay_style: bench peers compares a constant rate "
                          "(lr_decay_style=constant, lr_warmup_steps=0)")
    samples = cfg.batch.samples_per_prompt
    return dict(
        per_device_train_batch_size=cfg.batch.num_prompts_per_batch * samples,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=samples,
        max_completion_length=agent.max_new_tokens_per_turn,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
        top_k=max(cfg.rollout.top_k, 0),
        learning_rate=opt.lr, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_epsilon=opt.adam_eps,
        max_grad_norm=opt.clip_grad,
        beta=obj.kl_coef,
        loss_type=_LOSS_TYPE[obj.loss_agg], scale_rewards=_SCALE_REWARDS[obj.advantage],
        seed=cfg.run.seed, shuffle_dataset=False,
        bf16=False, fp16=False, gradient_checkpointing=False, use_vllm=False, disable_dropout=True,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False, mask_truncated_completions=False,
    )


def _step_times(metrics: Path) -> tuple[list[float], list[float]]:
    rows = step_rows(metrics)
    return [r["step_s"] for r in rows], [r["reward_mean"] for r in rows]


def run_trl(config: str, overrides: list[str], model: Path, steps: int, out: Path) -> dict[str, list[float]]:
    """TRL in its own process (``megathunder.bench.peer_trl``); its per-step times and rewards."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"config": config, "overrides": overrides, "model": str(model),
                                "steps": steps, "out": str(out)}))
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "megathunder.bench.peer_trl", str(spec)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL's run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads((out / "trl.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megathunder bench peers", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs/quickstart.yaml"),
                   help="the workload (default: the quickstart; e.g. configs/smollm2_arithmetic.yaml "
                        "learner.model.hf_checkpoint=models/smollm2)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per system")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="default: all three")
    p.add_argument("--rounds", type=positive, default=1,
                   help="run every system N times, every other round in reverse order; ratios are medians over rounds")
    p.add_argument("--out", default=None, help="keep the runs here (default: a temporary folder)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every system")
    args = p.parse_args(argv)
    overrides = [f"run.num_steps={args.steps}", "run.progress=false", "run.wandb=disabled",
                 "run.checkpoint_every=0", "eval.every_n_steps=0", *args.overrides]
    try:
        cfg = load_config(args.config, overrides)
        trl_arguments(cfg)  # refuse a workload TRL cannot match before anything runs
    except ConfigError as e:
        print(f"megathunder bench peers: {e}", file=sys.stderr)
        return 2
    if "trl" in args.systems:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("megathunder bench peers: TRL is not installed: pip install -e '.[peers]'", file=sys.stderr)
            return 2
    per_round: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        warm: list[str] = []
        model = Path(cfg.learner.model.hf_checkpoint) if cfg.learner.model.hf_checkpoint else None
        for r in range(args.rounds):
            report: dict[str, dict[str, Any]] = {}
            for system in alternate(args.systems, r):
                out = root / system if args.rounds == 1 else root / f"round{r}" / system
                if system == "trl":
                    if model is None:
                        raise RuntimeError("no model for TRL: run sync or thunder first, or set learner.model.hf_checkpoint")
                    res = run_trl(args.config, [*overrides, *warm], model, args.steps, out)
                    times, rewards = res["step_s"], res["reward_mean"]
                else:
                    _train(args.config, out, [*overrides, *warm, f"schedule.mode={system}"])
                    times, rewards = _step_times(out / "metrics.jsonl")
                    if not warm:  # later systems start from this run's model (warm-started or built)
                        for name in ("sft_model", "init_model"):
                            if (out / name).is_dir():
                                model = out / name
                                warm = [f"learner.model.hf_checkpoint={model}", "sft.num_steps=0"]
                                break
                report[system] = {"step_s": median_after_first(times), "step_times": times, "reward_mean": rewards}
                print(f"  {system:<8} {report[system]['step_s']:7.3f} s/step (median after the first)"
                      + (f"  (round {r})" if args.rounds > 1 else ""), flush=True)
            per_round.append({s: report[s] for s in args.systems})
    report = per_round[0] if args.rounds == 1 else median_of_rounds(per_round)
    _print_table(report)
    print(json.dumps(report))
    return 0


def median_of_rounds(per_round: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per system the median of its rounds' step times (each kept in ``rounds_step_s``), and with
    TRL each system's per-round step-time ratio to that round's TRL (``rounds_vs_trl``); step times
    and rewards per step are the first round's (every round samples the same, seeded)."""
    merged = {s: {**per_round[0][s], "rounds_step_s": [rnd[s]["step_s"] for rnd in per_round]} for s in per_round[0]}
    for s, m in merged.items():
        m["step_s"] = statistics.median(m["rounds_step_s"])
        if "trl" in merged and s != "trl":
            m["rounds_vs_trl"] = [rnd[s]["step_s"] / rnd["trl"]["step_s"] for rnd in per_round]
    return merged


def _print_table(report: dict[str, dict[str, Any]]) -> None:
    systems = list(report)
    if "trl" in report:
        for s in systems:
            if s != "trl":
                ratios = report[s].get("rounds_vs_trl")
                ratio = statistics.median(ratios) if ratios else report[s]["step_s"] / report["trl"]["step_s"]
                each = f" (median of {len(ratios)} rounds: " + " ".join(f"{x:.2f}" for x in ratios) + ")" if ratios else ""
                print(f"{s}/trl step time: {ratio:.2f}x{each}")
    print("reward per step: " + "  ".join(f"{s:>8}" for s in systems))
    for k in range(max(len(r["reward_mean"]) for r in report.values())):
        cells = [f"{r['reward_mean'][k]:8.3f}" if k < len(r["reward_mean"]) else " " * 8 for r in report.values()]
        print(f"  step {k:<9} " + "  ".join(cells))


if __name__ == "__main__":
    raise SystemExit(main())
