"""Discrete-event simulation of sync, async, fully-async and thunder schedules at cluster scale.

    profile = load_profile("swe_smith")            # timings: FLOPs/roofline estimates or measured
    traces = simulate(profile)                      # every schedule on the same sampled batches
    summary(traces["thunder"])                      # step time, idle shares, steps per GPU-hour

See ``megathunder simulate --help`` and ``megathunder/simulate/README.md``.
"""

from megathunder.simulate.profile import Profile, load_profile
from megathunder.simulate.schedule_model import SCHEDULES, Trace, simulate
from megathunder.simulate.sim_metrics import overlap_bound, step_table, summary

__all__ = ["Profile", "SCHEDULES", "Trace", "load_profile", "overlap_bound", "simulate", "step_table",
           "summary"]
