"""``megathunder tasks``: check benchmark tasks, convert SWE records, set up the SWE harness.

- ``megathunder tasks check PATH... [--config CFG] [--set key=value ...]``: runs each task's
  oracle and a do-nothing agent in the config's sandbox (``task_check.py``); prints a table and one
  JSON line; exits 1 when a task's oracle fails, its do-nothing agent passes or its environment
  fails. A PATH is a directory of Terminal-Bench / Harbor tasks or a JSONL / parquet file of SWE
  records (5.x or converted: SWE-smith ones by their ``log_parser``).
- ``megathunder tasks convert-swe IN OUT``: classic SWE-bench and SWE-smith records to the 5.x form
  (``swe_harness.py``); 5.x records are copied as they are.
- ``megathunder tasks setup-harness [--dir D]``: the harness environment those need (swebench 4.x
  and swesmith from the package index, in a virtual environment of their own).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from megathunder.config import ConfigError, Config


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="tasks_command", required=True, metavar="ACTION")
    c = sub.add_parser("check", help="run each task's oracle and a do-nothing agent; report tasks whose reward lies")
    c.add_argument("paths", nargs="*", metavar="PATH", help="task directories or SWE record files "
                   "(default: the config's task.path)")
    add_check_arguments(c)
    v = sub.add_parser("convert-swe", help="classic SWE-bench / SWE-smith records -> SWE-bench 5.x records "
                       "(the eval script their harness generates)")
    v.add_argument("input", help="JSONL or parquet file of records")
    v.add_argument("output", help="JSONL file to write")
    v.add_argument("--harness-python", default=None, help="the harness environment's Python "
                   "(default $MEGATHUNDER_SWE_HARNESS_PYTHON, else /opt/megathunder-swe-harness/bin/python)")
    v.add_argument("--namespace", default="swebench", help="image namespace of SWE-bench instance images")
    s = sub.add_parser("setup-harness", help="make the SWE harness environment (swebench 4.x, swesmith)")
    s.add_argument("--dir", default=None, help="where (default /opt/megathunder-swe-harness)")


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML config: its sandbox, verifier, agent and task.test_run")
    p.add_argument("--set", nargs="*", default=[], metavar="key=value", help="overrides, e.g. sandbox.backend=podman")
    p.add_argument("--concurrency", type=int, default=None, help="instances checked at once "
                   "(default task.check_concurrency)")


def _kind(path: str) -> str:
    """The task kind of ``path``: a directory of task directories, else a file of SWE records
    (SWE-smith ones when converted so)."""
    if Path(path).is_dir():
        return "terminal_bench"
    from megathunder.rollout.tasks.datasets import read_records
    from megathunder.rollout.tasks.swe_harness import SWESMITH_PARSER

    return "swe_smith" if read_records(path)[0][1].get("log_parser") == SWESMITH_PARSER else "swe_bench"


def load_tasks(args: argparse.Namespace) -> tuple[Config, list]:
    """The check's config and, per PATH, the config with that task and the task built."""
    from megathunder.config import load_config
    from megathunder.rollout.tasks import build_task

    paths = args.paths
    if not paths:
        task = load_config(args.config, args.set).task
        if not hasattr(task, "path"):
            raise ConfigError("megathunder tasks check: no PATH, and the config's task has no task.path")
        paths = [task.path]
    cfg = load_config(args.config, [o for o in args.set if not o.startswith("task.")])  # the task comes per PATH
    tasks = []
    for path in paths:
        full = load_config(args.config, [*args.set, f"task.name={_kind(path)}", f"task.path={path}"])
        tasks.append((full, build_task(full.task)))
    return cfg, tasks


def run_check(args: argparse.Namespace) -> tuple[list, float, Config]:
    from megathunder.rollout.tasks.task import DatasetTask
    from megathunder.rollout.tasks.task_check import check_instances

    cfg, tasks = load_tasks(args)
    checks = []
    start = time.monotonic()
    for full, task in tasks:
        assert isinstance(task, DatasetTask)
        concurrency = args.concurrency or full.task.check_concurrency
        checks += asyncio.run(check_instances(task, task.all_instances(), full.sandbox, full.verifier, full.agent,
                                              concurrency=concurrency))
        close = getattr(task, "close", None)
        if close is not None:
            close()
    return checks, time.monotonic() - start, cfg


def _check(args: argparse.Namespace) -> int:
    from megathunder.rollout.tasks.task_check import format_table, report_rows

    checks, seconds, cfg = run_check(args)
    print(format_table(checks))
    print(json.dumps({"command": "tasks check", "sandbox": cfg.sandbox.backend, "seconds": round(seconds, 1),
                      "ok": all(c.ok for c in checks), "tasks": report_rows(checks)}))
    return 0 if all(c.ok for c in checks) else 1


def _convert(args: argparse.Namespace) -> int:
    from megathunder.rollout.tasks.datasets import DatasetError, read_records
    from megathunder.rollout.tasks.swe_harness import HarnessError, convert_records

    try:
        records = read_records(args.input)
        out = convert_records(records, args.harness_python, args.namespace)
    except (DatasetError, HarnessError) as err:
        print(f"megathunder tasks convert-swe: {err}", file=sys.stderr)
        return 2
    Path(args.output).write_text("".join(json.dumps(r) + "\n" for r in out))
    kinds = {"swesmith" if r.get("log_parser") == "swesmith" else "swe_bench" for r in out}
    print(json.dumps({"command": "tasks convert-swe", "records": len(out), "output": args.output,
                      "kinds": sorted(kinds)}))
    return 0


def _setup(args: argparse.Namespace) -> int:
    from megathunder.rollout.tasks.swe_harness import DEFAULT_DIR, HarnessError, setup_harness

    try:
        python = setup_harness(args.dir or DEFAULT_DIR)
    except (HarnessError, OSError) as err:
        print(f"megathunder tasks setup-harness: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"command": "tasks setup-harness", "python": python}))
    return 0


def run(args: argparse.Namespace) -> int:
    from megathunder.rollout.tasks.datasets import DatasetError
    from megathunder.rollout.tasks.swe_harness import HarnessError

    try:
        return {"check": _check, "convert-swe": _convert, "setup-harness": _setup}[args.tasks_command](args)
    except (DatasetError, HarnessError) as err:
        print(f"megathunder tasks {args.tasks_command}: {err}", file=sys.stderr)
        return 2
