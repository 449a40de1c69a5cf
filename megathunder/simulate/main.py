"""``megathunder simulate PROFILE``: run the four schedules on a workload profile, print the
figures, write the tables and pictures; the last line is one JSON object."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from megathunder.simulate import report
from megathunder.simulate.profile import bundled_profiles, load_profile
from megathunder.simulate.schedules import SCHEDULES, simulate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megathunder simulate", description=__doc__)
    p.add_argument("profile", help=f"bundled profile ({', '.join(bundled_profiles())}) or a YAML path")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. schedules.max_group_slots=0 run.num_steps=10")
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    p.add_argument("--out", type=Path, default=None,
                   help="where tables and pictures go (default runs/simulate/PROFILE)")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    p.add_argument("--sensitivity", action="store_true",
                   help="also sweep K, tail heaviness, tool latency and the GPU split (slower)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    profile = load_profile(args.profile, args.overrides)
    t0 = time.perf_counter()
    traces = simulate(profile, tuple(args.schedules))
    elapsed = time.perf_counter() - t0
    figs = report.figures(traces)
    print(report.format_figures(profile, figs))
    print(f"simulated in {elapsed:.2f} s")
    out = args.out or Path("runs/simulate") / profile.name
    written = report.write_tables(traces, figs, out)
    if not args.no_plots:
        written.append(report.plot_timeline(traces, out / "timeline.png"))
    if args.sensitivity:
        rows = report.sensitivity(profile)
        print("\nsensitivity (thunder / sync, bound B):")
        for r in rows:
            print(f"  {r['sweep']:<40}{str(r['value']):>6}  {r['thunder_vs_sync']:.3f}  {r['B']:.3f}")
        import csv

        sens = out / "sensitivity.csv"
        with sens.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        written.append(sens)
        if not args.no_plots:
            written.append(report.plot_sensitivity(rows, out / "sensitivity.png",
                                                   f"{profile.name}: thunder vs sync"))
    print("wrote " + ", ".join(str(p) for p in written))
    print(report.last_line(profile, figs))
    return 0
