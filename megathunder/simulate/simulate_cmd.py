"""``megathunder simulate PROFILE``: run the schedules on a workload profile, print the figures,
write the tables and pictures; the last line is one JSON object. ``megathunder simulate
--config CONFIG [PROFILE]``: a megathunder config's layout, ledger and scheduling on a profile's
workload (default the SWE-smith-like one at 128 GPUs; ``layout.py``). ``megathunder simulate
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
from megathunder.simulate.layout import hold
from megathunder.simulate.profile import TRAINER_PREFIX, TrainerSpec, load_profile
from megathunder.simulate.run_dir import load_run
from megathunder.simulate.schedule_model import simulate


CONFIG_WORKLOAD = "swe_smith_128"  # ``--config`` without a PROFILE: the SWE-smith-like workload at 128 GPUs


def run(args: argparse.Namespace) -> int:
    if args.profile is not None and "=" in args.profile and not Path(args.profile).is_file():
        args.overrides, args.profile = [args.profile, *args.overrides], None  # `--config C key=value`: no PROFILE
    if args.calibrate:
        if args.profile is not None or args.overrides or args.config:
            raise ConfigError("simulate --calibrate RUN_DIR ...: takes run directories, not a profile")
        return run_calibration(args.calibrate, Path(args.out or "runs/simulate/calibrate"))
    if args.profile is None and args.config is None:
        raise ConfigError("simulate: give a PROFILE (bundled: swe_smith, swe_smith_128), --config CONFIG or "
                          "--calibrate RUN_DIR")
    profile = load_profile(args.profile or CONFIG_WORKLOAD, args.overrides)
    if args.config is not None:  # the config's layout and ledger, the profile's workload and model sizes
        own = [o.removeprefix(TRAINER_PREFIX) for o in args.overrides if o.startswith(TRAINER_PREFIX)]
        model = profile.trainer.model if profile.trainer is not None else []
        profile = profile.model_copy(update={"trainer": TrainerSpec(config=args.config, model=model, overrides=own)})
    held = hold(profile)
    profile = held.profile
    schedules = tuple(s for s in args.schedules if s != "thunder" or held.thunder_refused is None)
    t0 = time.perf_counter()
    traces = simulate(profile, schedules)
    elapsed = time.perf_counter() - t0
    figs = report.figures(traces)
    print(report.format_figures(profile, figs, held))
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
    print(report.last_line(profile, figs, held))
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
