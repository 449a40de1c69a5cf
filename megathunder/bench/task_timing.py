"""``megathunder bench tasks``: where a benchmark task's time goes, per task, in the real sandbox.

Runs ``megathunder tasks check`` (each task's oracle and a do-nothing agent, through the agent
loop, in the config's sandbox) and reports per task: the image build's seconds (0 when the image
existed), each episode's seconds from sandbox start to reward, and each test run's own seconds --
the figures a schedule comparison needs for agentic tasks (a test suite is the verifier latency
thunder overlaps). The last line is one JSON object.

    megathunder bench tasks PATH... --config configs/terminal_bench.yaml [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics


def main(argv=None) -> int:
    from megathunder.rollout.tasks.tasks_cmd import add_check_arguments, run_check

    p = argparse.ArgumentParser(prog="megathunder bench tasks", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", metavar="PATH", help="task directories or SWE record files")
    add_check_arguments(p)
    args = p.parse_args(argv)
    checks, seconds, cfg = run_check(args)
    rows = []
    print(f"sandbox {cfg.sandbox.backend}; {len(checks)} tasks in {seconds:.1f} s (oracle and null agent together "
          f"per task, {args.concurrency or 'task.check_concurrency'} at a time)")
    print(f"{'task':<30} {'verdict':<16} {'build s':>8} {'oracle s':>9} {'null s':>7} {'oracle test s':>14} "
          f"{'null test s':>12}")
    for c in checks:
        row = {"task": c.instance_id, "verdict": ",".join(c.problems) or "ok", "build_s": round(c.build_s, 2),
               "oracle_s": None if c.oracle is None else round(c.oracle.seconds, 2),
               "null_s": None if c.null is None else round(c.null.seconds, 2),
               "oracle_test_s": None if c.oracle is None else c.oracle.test_s,
               "null_test_s": None if c.null is None else c.null.test_s}
        rows.append(row)
        cells = [row[k] for k in ("build_s", "oracle_s", "null_s", "oracle_test_s", "null_test_s")]
        print(f"{c.instance_id[:30]:<30} {row['verdict']:<16} " + " ".join(
            f"{'-' if v is None else f'{v:.2f}':>{w}}" for v, w in zip(cells, (8, 9, 7, 14, 12), strict=True)))
    means = {k: statistics.fmean(r[k] for r in rows if r[k] is not None)
             for k in ("build_s", "oracle_s", "null_s", "oracle_test_s", "null_test_s")
             if any(r[k] is not None for r in rows)}
    print("mean: " + ", ".join(f"{k} {v:.2f}" for k, v in means.items()))
    print(json.dumps({"bench": "tasks", "sandbox": cfg.sandbox.backend, "seconds": round(seconds, 1),
                      "tasks": rows, "mean": {k: round(v, 3) for k, v in means.items()}}))
    return 0
