"""``megathunder simulate PROFILE``: run the schedules on a workload profile, print the figures,
write the tables and pictures; the last line is one JSON object. ``megathunder simulate
--calibrate RUN_DIR ...``: predicted vs measured step time of real runs (``calibrate.py``).
Arguments: ``megathunder.cli``."""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

from megathunder.config.loader import ConfigError
from megathunder.simulate import sim_report as report
from megathunder.simulate.calibrate import calibrate
from megathunder.simulate.profile import load_profile
from megathunder.simulate.run_dir import load_run
from megathunder.simulate.schedule_model import simulate


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        if args.profile is not None or args.overrides:
            raise ConfigError("simulate --calibrate RUN_DIR ...: takes run directories, not a profile")
        return run_calibration(args.calibrate, Path(args.out or "runs/simulate/calibrate"))
    if args.profile is None:
        raise ConfigError("simulate: give a PROFILE (bundled: swe_smith, swe_smith_128) or --calibrate RUN_DIR")
    profile = load_profile(args.profile, args.overrides)
    t0 = time.perf_counter()
    traces = simulate(profile, tuple(args.schedules))
    elapsed = time.perf_counter() - t0
    figs = report.figures(traces)
    print(report.format_figures(profile, figs))
    print(f"simulated in {elapsed:.2f} s")
    out = Path(args.out) if args.out else Path("runs/simulate") / profile.name
    written = report.write_tables(traces, figs, out)
    if not args.no_plots:
        written.append(report.plot_timeline(traces, out / "timeline.png"))
    if args.sensitivity:
        rows = report.sensitivity(profile)
        print("\nsensitivity: thunder / sync and the bound B")
        for r in rows:
            print(f"  {r['sweep']:<40}{str(r['value']):>6}  {r['thunder_vs_sync']:.3f}  {r['B']:.3f}")
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


def run_calibration(run_dirs: list[str], out: Path) -> int:
    """Each run: fit, simulate, compare; the fitted profiles go to ``out``."""
    runs = [load_run(path) for path in run_dirs]  # every directory checked before any work
    results = [calibrate(run) for run in runs]
    out.mkdir(parents=True, exist_ok=True)
    print(report.format_calibration(results))
    written = [report.write_profile(r.pop("profile"), out) for r in results]
    print("wrote " + ", ".join(str(p) for p in written))
    print(report.calibration_last_line(results))
    return 0
