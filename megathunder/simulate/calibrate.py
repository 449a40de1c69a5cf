"""Calibration: fit the simulator's inputs from a real run's component timings, replay that run's
workload under its schedule, and compare the predicted step time with the measured one.

    run = load_run("runs/bench/tools/thunder")
    cal = fit(run)                     # a Profile + the run's batches; never the step times
    predict(cal, replay=True)          # {"step_s": ..., "learner_idle_share": ...}

Fitted inputs (see ``README.md``, "Calibration against real runs"):

- each turn's generation: *replayed* as measured (its ``generate`` span: on a CPU this includes
  the slowdown from the learner computing on the same cores, and any stall of the machine), or
  *modelled* by ``rollout.decode_tokens_per_s``, the engine's aggregate decode tokens/s at each
  concurrency c (turns generating at once): per bin of turns by mean concurrency, their tokens
  over their seconds, times c (``fit_decode_table``; prefill and request handling folded in);
- the workload, replayed step by step: per trajectory its group, prompt and total tokens, its
  set-up before its first turn (sandbox built, task set up in it), its turns' generated tokens, the
  time between turns (tool calls and the agent loop) and from its last turn to its reward
  (verifier);
- each step's learner work: *replayed* as its gradient calls' measured seconds (begin / finished /
  reward / close), shared by its trajectories by tokens; or *modelled* by
  ``learner.seconds_per_token``, those calls after the first step (which runs cold and is left
  out of the measured mean too) over those steps' tokens;
- ``learner.optimizer_step_s``: the mean ``step`` call after the first step;
  ``learner.weight_sync_s``: the mean weight sync (gather, reshard, load into vLLM, probe), the
  initial one left out, and ``learner.weight_sync_learner_s`` the learner's calls in it;
- the run's config: schedule, batch shape, the ledger's K, gradients before the reward
  (``ledger.max_pending`` not 0) and per-turn score gradients (``ledger.per_turn_scores``:
  kv_adjoint, forward_early; recompute runs its backward at the finish, as pending gradients
  do), whether thunder's learner held its work while an in-process engine decoded on its cores
  (``ledger.hold_while_generating``), fully_async's groups in flight; and the trainer's order:
  async pushes before it trains.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from megathunder.simulate.profile import Dist, Profile
from megathunder.simulate.run_dir import Episode, RunDir, Turn, load_run
from megathunder.simulate.schedule_model import RUNNERS
from megathunder.simulate.sim_metrics import summary
from megathunder.simulate.workload import Batch

GRADIENT_CALLS = frozenset({"begin", "turn", "finished", "reward", "close"})
PUSH_CALLS = frozenset({"send_weights", "gather_weights", "score"})  # the learner's calls inside a weight sync
MIN_TURNS_PER_BIN = 50  # decode-rate bins: fewer turns than this join the next bin
PREFILL_FOLDED_TOKENS_PER_S = 1e12  # prefill time is inside the fitted decode rates
FULLY_ASYNC_IN_FLIGHT_BATCHES = 2  # megathunder.trainer.schedules.run_fully_async's semaphore


@dataclass
class Calibration:
    run: RunDir
    profile: Profile
    batches: list[Batch]  # one per step, in step order


# ---------------------------------------------------------------------- fitting


def concurrency_exposure(turns: list[Turn]) -> np.ndarray:
    """tau[i, c - 1]: seconds turn i spent generating while c turns (itself included) were."""
    edges = sorted([(t.start, 1, i) for i, t in enumerate(turns)] + [(t.end, -1, i) for i, t in enumerate(turns)],
                   key=lambda e: (e[0], e[1]))
    tau = np.zeros((len(turns), max(1, _max_concurrency(edges))))
    active: set[int] = set()
    prev = edges[0][0] if edges else 0.0
    for t, delta, i in edges:
        if active and t > prev:
            tau[list(active), len(active) - 1] += t - prev
        prev = t
        (active.add if delta > 0 else active.discard)(i)
    return tau


def _max_concurrency(edges) -> int:
    level = peak = 0
    for _, delta, _ in edges:
        level += delta
        peak = max(peak, level)
    return peak


def fit_decode_table(turns: list[Turn]) -> list[tuple[float, float]]:
    """[(concurrency, aggregate tokens/s)]: turns binned by their mean concurrency (1, 2, 3-4,
    5-8, ...; a bin of fewer than ``MIN_TURNS_PER_BIN`` turns joins the next); per bin, the
    per-sequence rate is its tokens over its generation seconds (a ratio of sums: time-weighted, so
    engine stalls, and on a CPU the learner computing on the same cores, count as the time they
    took), times the bin's mean concurrency. Below the first bin and above the last, up to the
    highest concurrency seen, the per-sequence rate stays the nearest bin's."""
    tau = concurrency_exposure(turns)
    seconds = tau.sum(axis=1)
    timed = seconds > 0
    if not timed.any():
        raise ValueError("decode rates: no turn took any time")
    mean_c = (tau * np.arange(1, tau.shape[1] + 1)).sum(axis=1)[timed] / seconds[timed]
    tokens, seconds = np.array([t.tokens for t in turns], dtype=float)[timed], seconds[timed]
    bins = np.ceil(np.log2(mean_c) - 1e-9).astype(int)
    groups: list[np.ndarray] = []
    for b in np.unique(bins):
        members = np.flatnonzero(bins == b)
        if groups and len(groups[-1]) < MIN_TURNS_PER_BIN:
            groups[-1] = np.concatenate([groups[-1], members])
        else:
            groups.append(members)
    if len(groups) > 1 and len(groups[-1]) < MIN_TURNS_PER_BIN:
        groups[-2:] = [np.concatenate(groups[-2:])]
    table = []
    for m in groups:
        c = float((mean_c[m] * seconds[m]).sum() / seconds[m].sum())
        table.append((c, c * float(tokens[m].sum() / seconds[m].sum())))
    if table[0][0] > 1:
        table.insert(0, (1.0, table[0][1] / table[0][0]))
    top = float(tau.shape[1])  # the highest concurrency seen
    if table[-1][0] < top:
        table.append((top, table[-1][1] / table[-1][0] * top))
    return table


def replay_batch(episodes: list[Episode]) -> Batch:
    """One step's trajectories as the simulator's batch (groups renumbered 0.. in group order)."""
    eps = sorted(episodes, key=lambda e: (e.group, e.start))
    gid = {g: k for k, g in enumerate(sorted({e.group for e in eps}))}
    dec, gen, obs, gaps, verify, turns = [], [], [], [], [], []
    for e in eps:
        ts = e.turns or [Turn(e.start, e.finished, 1)]
        d = [t.tokens for t in ts]
        n_obs = max(0, e.tokens - e.prompt_tokens - sum(d))
        split = np.diff(np.linspace(0, n_obs, len(ts), dtype=np.int64)) if len(ts) > 1 else np.zeros(0, np.int64)
        dec += d
        gen += [t.end - t.start for t in ts]
        obs += [*split.tolist(), 0]
        gaps += [b.start - a.end for a, b in itertools.pairwise(ts)] + [0.0]
        verify.append(e.reward - ts[-1].end)
        turns.append(len(ts))
    return Batch(group=np.array([gid[e.group] for e in eps]), prompt_tokens=np.array([e.prompt_tokens for e in eps]),
                 turn_start=np.concatenate([[0], np.cumsum(turns)]).astype(np.int64),
                 decode_tokens=np.array(dec, dtype=np.int64), observation_tokens=np.array(obs, dtype=np.int64),
                 tool_latency_s=np.maximum(0.0, gaps), verifier_latency_s=np.maximum(0.0, verify),
                 decode_s=np.array(gen), setup_s=np.array([e.setup_s for e in eps]))


def _dist(values) -> Dist:
    x = np.asarray(values, dtype=float)
    if x.size == 0 or (x <= 0).all() or np.ptp(x) == 0:
        return Dist(kind="constant", value=float(x.mean()) if x.size else 0.0)
    return Dist.fit(x[x > 0])


def fit(run: RunDir) -> Calibration:
    """The simulator's inputs from the run's component timings (never its step times)."""
    cfg = run.config
    by_step: dict[int, list[Episode]] = defaultdict(list)
    for e in run.episodes:
        by_step[e.step].append(e)
    grad_by_step: dict[int, float] = defaultdict(float)
    for s in run.learner:
        if s.kind in GRADIENT_CALLS:
            grad_by_step[s.step] += s.duration
    batches = []
    for k in sorted(by_step):  # replayed: each step's learner seconds shared by its tokens
        b = replay_batch(by_step[k])
        tokens_k = b.total_tokens.astype(float)
        batches.append(dataclasses.replace(b, work_s=tokens_k * grad_by_step[k] / tokens_k.sum()))
    num_steps = len(run.metrics)
    warmup = min(1, num_steps - 1)  # the first step's learner calls run cold: left out, as when measuring
    tokens = sum(int(b.total_tokens.sum()) for b in batches[warmup:])
    grad_s = sum(grad_by_step[k] for k in grad_by_step if k >= warmup)
    steps = [s.duration for s in run.learner if s.kind == "step" and s.step >= warmup]
    syncs = run.weight_syncs[1:] if len(run.weight_syncs) > 1 else run.weight_syncs  # [0]: before step 0
    in_sync = [s.duration for s in run.learner if s.kind in PUSH_CALLS
               and any(w.start <= s.start and s.end <= w.end for w in syncs)]
    P, S = cfg["batch"]["num_prompts_per_batch"], cfg["batch"]["samples_per_prompt"]
    model = cfg["learner"]["model"]
    cat = lambda f: np.concatenate([f(b) for b in batches])  # noqa: E731
    not_last = lambda b: np.setdiff1d(np.arange(len(b.decode_tokens)), b.turn_start[1:] - 1)  # noqa: E731
    profile = Profile.model_validate({
        "name": "calibrated-" + "-".join(run.path.resolve().parts[-2:]),
        "description": f"fitted from {run.path} ({run.schedule})",
        "model": {"name": model.get("family", "model"), "num_params": 1.0, "num_layers": model["num_layers"],
                  "hidden_size": model["hidden_size"]},
        "cluster": {"gpu": "cpu", "num_rollout_gpus": 1, "peak_flops_per_gpu": 1.0,
                    "num_learner_gpus": cfg["learner"]["parallel"].get("data_parallel") or 1},
        "rollout": {"max_num_seqs": (FULLY_ASYNC_IN_FLIGHT_BATCHES + 1) * P * S,
                    "decode_tokens_per_s": fit_decode_table([t for e in run.episodes for t in e.turns]),
                    "prefill_tokens_per_s": PREFILL_FOLDED_TOKENS_PER_S},
        "learner": {"seconds_per_token": grad_s / tokens, "optimizer_step_s": float(np.mean(steps)),
                    "weight_sync_s": float(np.mean([w.duration for w in syncs])),
                    "weight_sync_learner_s": sum(in_sync) / len(syncs), "layerwise_overlap": False},
        "workload": {
            "num_prompts_per_batch": P, "samples_per_prompt": S,
            "prompt_tokens": _dist(cat(lambda b: b.prompt_tokens)), "turns": _dist(cat(lambda b: b.num_turns)),
            "tokens_per_turn": _dist(cat(lambda b: b.decode_tokens)),
            "observation_tokens_per_turn": _dist(cat(lambda b: b.observation_tokens[not_last(b)])),
            "tool_latency_s": _dist(cat(lambda b: b.tool_latency_s[not_last(b)])),
            "verifier_latency_s": _dist(cat(lambda b: b.verifier_latency_s)),
            "max_context_tokens": int(max(b.total_tokens.max() for b in batches)),
        },
        "schedules": {"max_group_slots": cfg["ledger"]["max_group_slots"], **_ledger_mechanisms(cfg),
                      "max_staleness": num_steps + FULLY_ASYNC_IN_FLIGHT_BATCHES + 1,  # no launch rule
                      "max_in_flight_prompts": FULLY_ASYNC_IN_FLIGHT_BATCHES * P,
                      "async_push_overlaps_training": False},
        "run": {"num_steps": num_steps, "warmup_steps": warmup, "seed": cfg["run"]["seed"]},
    })
    return Calibration(run, profile, batches)


def _ledger_mechanisms(cfg: dict) -> dict:
    """The run's thunder mechanisms the simulator models (older runs' configs lack the keys: off),
    and whether its learner held its work while the in-process engine decoded on its cores
    (``megathunder.host.Host.generation_hold``)."""
    ledger = cfg["ledger"]
    per_turn = ledger.get("per_turn_scores", "off")
    engine = cfg.get("rollout", {}).get("engine", {})
    own_cores = cfg.get("learner", {}).get("cpu_cores") is not None and engine.get("cpu_cores") is not None
    hold = (engine.get("deployment") == "in_process" and not own_cores and ledger.get("pack_window_s", 0.02) > 0
            and ledger.get("hold_while_generating", "in_process") == "in_process")
    return {"pending_gradients": ledger.get("max_pending", 0) != 0,
            "per_turn_scores": per_turn if per_turn in ("kv_adjoint", "forward_early") else "off",
            "hold_while_generating": hold}


# ---------------------------------------------------------------------- predicting, measuring


def predict(cal: Calibration, replay: bool) -> dict:
    """The run's schedule simulated on its own batches; ``replay``: each turn generates for its
    measured seconds and each step's learner work takes its measured seconds, else the fitted
    decode rates and learner seconds per token."""
    batches = cal.batches if replay else [dataclasses.replace(b, decode_s=None, work_s=None) for b in cal.batches]
    if cal.run.schedule == "fully_async":  # groups still in flight at the end: the run's again
        extra = FULLY_ASYNC_IN_FLIGHT_BATCHES + 1
        batches = batches + [batches[k % len(batches)] for k in range(extra)]
    trace = RUNNERS[cal.run.schedule](cal.profile, batches)
    return summary(trace)


def measured(run: RunDir, warmup_steps: int) -> dict:
    """Mean step time and learner idle share after the warm-up, from ``metrics.jsonl``."""
    rows = run.metrics[warmup_steps:]
    wall = sum(r["step_s"] for r in rows)
    return {"step_s": wall / len(rows), "learner_idle_share": 1 - sum(r["learner_busy_s"] for r in rows) / wall}


def calibrate(run: RunDir) -> dict:
    """Measured vs predicted with turns replayed (``predicted_*``, ``error``) and with the fitted
    decode rates (``model_*``)."""
    cal = fit(run)
    meas = measured(run, cal.profile.run.warmup_steps)
    pred, model = predict(cal, replay=True), predict(cal, replay=False)
    lrn = cal.profile.learner
    gaps = [g for b in cal.batches for g in b.tool_latency_s[b.tool_latency_s > 0]]
    generate_s: list[float] = []
    for b in cal.batches:
        assert b.decode_s is not None  # fit() measures every turn
        generate_s.extend(b.decode_s)
    return {
        "run": str(run.path), "schedule": run.schedule, "steps": len(run.metrics),
        "measured_step_s": meas["step_s"], "predicted_step_s": pred["step_s"],
        "error": pred["step_s"] / meas["step_s"] - 1,
        "model_step_s": model["step_s"], "model_error": model["step_s"] / meas["step_s"] - 1,
        "measured_learner_idle": meas["learner_idle_share"], "predicted_learner_idle": pred["learner_idle_share"],
        "fitted": {
            "decode_tokens_per_s": cal.profile.rollout.decode_tokens_per_s,
            "generate_s_mean": float(np.mean(generate_s)),
            "learner_seconds_per_token": lrn.seconds_per_token, "optimizer_step_s": lrn.optimizer_step_s,
            "weight_sync_s": lrn.weight_sync_s, "weight_sync_learner_s": lrn.weight_sync_learner_s,
            "tool_gap_s_mean": float(np.mean(gaps or [0.0])),
            "verifier_s_mean": float(np.mean([v for b in cal.batches for v in b.verifier_latency_s])),
        },
        "profile": cal.profile,
    }


def schedule_estimates(path) -> dict[str, float]:
    """What this run would have cost under the other zero-staleness schedule: its own workload
    (each turn's generation, tool and verifier time, each step's learner work, the weight syncs,
    all as measured: ``fit``) replayed under ``sync`` and under ``thunder`` by the simulator.
    Returns each schedule's predicted mean step time and thunder's gain over sync; both figures
    come from the same replay, so the calibration's error cancels in the ratio. (The learner's
    work is replayed as measured under the run's own schedule: per trajectory under thunder, the
    batch's under sync.)"""
    cal = fit(load_run(path))
    steps = {mode: summary(RUNNERS[mode](cal.profile, cal.batches))["step_s"] for mode in ("sync", "thunder")}
    return {"sim_sync_step_s": steps["sync"], "sim_thunder_step_s": steps["thunder"],
            "sim_thunder_speedup": steps["sync"] / steps["thunder"]}

