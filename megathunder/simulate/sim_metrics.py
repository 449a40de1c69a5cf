"""Figures from a trace: per-step and steady-state rates, idle shares, the overlap bound.

Busy time of a lane is the union of its intervals (a learner sending weights while it trains is
busy once). Learner lanes are data-parallel ranks, rollout lanes are engines. Learner work is
training, the optimizer step and the weight push; rollout work is decoding (at least one sequence
resident). Steady-state figures leave out the first ``run.warmup_steps`` steps.

The overlap bound. In a synchronous step the learner waits W (rollout start to last reward), then
works T (last reward to weights live). A zero-staleness schedule cannot start a rollout before
the previous step's weights are live, so its step lasts at least W; its learner does at least
the same work, so at least T. Hence its steps per GPU-hour relative to sync are at most

    B = sum_k (W_k + T_k) / sum_k max(W_k, T_k)

(over the same sampled batches; exact with one data-parallel rank and no pipeline, where the
learner's work cannot be balanced better than the batch-synchronous learner does).

B ignores *when* the work arrives. ``B_arrival`` does not: no trajectory's backward can start
before its reward r_i, so a step lasts at least max_i (r_i + work arriving at or after r_i) plus
the update tail (``schedules.arrival_bound_s``). The learner idles until the first reward of its
step in any zero-staleness schedule, so B_arrival < B, markedly so when W ~ T.
"""

from __future__ import annotations

import numpy as np

from megathunder.simulate.profile import Profile
from megathunder.simulate.schedule_model import Trace

PUBLISHED_SYNC_IDLE_SHARE = 0.495  # seed paper: learners idle 49.5% of a synchronous GRPO step
PUBLISHED_STEPS = (15, 8)  # seed paper: 15 thunder steps in the GPU-hours sync needs for 8


def merged_lanes(trace: Trace) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    by_lane: dict[str, list[tuple[float, float]]] = {}
    for iv in trace.intervals:
        if iv.end > iv.start:
            by_lane.setdefault(iv.lane, []).append((iv.start, iv.end))
    out = {}
    for lane, ivs in by_lane.items():
        ivs.sort()
        starts, ends = [ivs[0][0]], [ivs[0][1]]
        for s, e in ivs[1:]:
            if s <= ends[-1]:
                ends[-1] = max(ends[-1], e)
            else:
                starts.append(s)
                ends.append(e)
        out[lane] = (np.asarray(starts), np.asarray(ends))
    return out


def busy_s(lanes: dict, prefix: str, a: float, b: float) -> float:
    """Busy seconds of every lane named prefix*, within [a, b], summed over lanes."""
    total = 0.0
    for lane, (s, e) in lanes.items():
        if lane.startswith(prefix):
            total += float(np.clip(np.minimum(e, b) - np.maximum(s, a), 0, None).sum())
    return total


def step_table(trace: Trace) -> list[dict]:
    prof = trace.profile
    lanes = merged_lanes(trace)
    rows, prev = [], 0.0
    for st in trace.steps:
        wall = st.end - prev
        learner = busy_s(lanes, "learner", prev, st.end) / (prof.num_dp * wall)
        rollout = busy_s(lanes, "rollout", prev, st.end) / (prof.num_engines * wall)
        rows.append({
            "schedule": trace.schedule, "step": st.step, "start_s": prev, "end_s": st.end,
            "wall_s": wall, "rollout_wait_s": st.rollout_wait_s, "learner_tail_s": st.learner_tail_s,
            "learner_idle_share": 1 - learner, "rollout_busy_share": rollout,
            "staleness_mean": float(st.staleness.mean()), "staleness_max": float(st.staleness.max()),
        })
        prev = st.end
    return rows


def summary(trace: Trace) -> dict:
    prof: Profile = trace.profile
    w = prof.run.warmup_steps
    steps = trace.steps
    a = steps[w - 1].end if w else 0.0
    b = steps[-1].end
    n = len(steps) - w
    step_s = (b - a) / n
    lanes = merged_lanes(trace)
    stale = np.concatenate([s.staleness for s in steps[w:]])
    return {
        "step_s": step_s,
        "steps_per_gpu_hour": 3600.0 / (step_s * prof.num_gpus),
        "learner_idle_share": 1 - busy_s(lanes, "learner", a, b) / (prof.num_dp * (b - a)),
        "rollout_busy_share": busy_s(lanes, "rollout", a, b) / (prof.num_engines * (b - a)),
        "staleness_mean": float(stale.mean()),
        "staleness_max": float(stale.max()),
    }


def overlap_bound(sync: Trace) -> dict:
    """W, T (means) and the bounds from a sync trace, over the steps after the warm-up (the
    same steps as ``summary``; the bounds hold step by step, so on any subset)."""
    steps = sync.steps[sync.profile.run.warmup_steps:]
    W = np.array([s.rollout_wait_s for s in steps])
    T = np.array([s.learner_tail_s for s in steps])
    A = np.array([s.arrival_bound_s for s in steps])
    return {"W_s": float(W.mean()), "T_s": float(T.mean()),
            "B": float((W + T).sum() / np.maximum(W, T).sum()),
            "B_arrival": float((W + T).sum() / A.sum())}


def zero_staleness_ratio(sync: Trace, other: Trace) -> float:
    """Steps per GPU-hour of ``other`` relative to sync after the warm-up (same batches)."""
    return summary(sync)["step_s"] / summary(other)["step_s"]
