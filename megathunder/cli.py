"""The ``megathunder`` command. Subcommands import their heavy modules only when they run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

BENCHMARKS = {
    "ledger": "megathunder.bench.ledger",
    "episodes": "megathunder.bench.episodes",
}


def _cmd_config(args: argparse.Namespace) -> int:
    import yaml

    from megathunder.config import load_config

    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[args.name])
    return module.main(args.bench_args)


def _cmd_exactness(args: argparse.Namespace) -> int:
    from megathunder.config import load_config
    from megathunder.exactness_run import run

    return run(load_config(args.config, args.overrides))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megathunder",
        description="On-policy RL and distillation for LLM agents with exact, zero-staleness "
        "gradient streaming (ThunderSyncRL).",
        epilog="Configs are YAML files (see configs/); override any field with dotted.key=value, "
        "e.g. ledger.max_group_slots=4 objective.kl_coef=1e-3.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("config", help="print the resolved, validated configuration")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser(
        "exactness",
        help="on-policy GRPO on a small in-process decoder; every step's streamed (thunder) "
        "gradient is checked against the batch-synchronous one before it is applied",
    )
    p.add_argument("config", help="YAML config file, e.g. configs/grpo_exactness.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=_cmd_exactness)

    p = sub.add_parser(
        "bench", help="run a benchmark; prints its figures, the last line one JSON object"
    )
    p.add_argument("name", choices=sorted(BENCHMARKS))
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark (try --help)")
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from megathunder.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"megathunder: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
