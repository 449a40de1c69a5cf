"""Tables (CSV/JSON), the printed figures, the timeline picture and the sensitivity sweep."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from megathunder.simulate import sim_metrics as metrics
from megathunder.simulate.layout import Held, memory_lines
from megathunder.simulate.ledger_model import Costs
from megathunder.simulate.profile import Profile
from megathunder.simulate.schedule_model import Trace, run_sync, run_thunder, sample_batches

COLORS = {"decode": "#4C72B0", "train": "#DD8452", "ledger": "#937860", "update": "#C44E52", "weight_sync": "#8C8C8C"}


def figures(traces: dict[str, Trace]) -> dict:
    """Everything printed and saved: per-schedule summaries and, with sync, the bounds."""
    out: dict = {"schedules": {name: metrics.summary(tr) for name, tr in traces.items()}}
    sync = traces.get("sync")
    if sync is not None:
        base = out["schedules"]["sync"]["steps_per_gpu_hour"]
        for s in out["schedules"].values():
            s["vs_sync"] = s["steps_per_gpu_hour"] / base
    if sync is not None:
        out["bound"] = metrics.overlap_bound(sync)
    if sync is not None and "thunder" in traces:
        bound = out["bound"]
        ratio = metrics.zero_staleness_ratio(sync, traces["thunder"])
        th = traces["thunder"].steps[traces["thunder"].profile.run.warmup_steps:]
        out["bound"] = {**bound, "thunder_vs_sync": ratio, "fraction_of_B": ratio / bound["B"],
                        "fraction_of_B_arrival": ratio / bound["B_arrival"],
                        "thunder_after_last_reward_s": float(np.mean([s.learner_tail_s for s in th])),
                        "first_reward_s": float(np.mean([s.first_reward_s for s in th]))}
    idle = metrics.PUBLISHED_SYNC_IDLE_SHARE
    a, b = metrics.PUBLISHED_STEPS
    out["published"] = {"sync_learner_idle_share": idle, "thunder_vs_sync": a / b,
                        "B_from_idle": 1 / (1 - idle), "fraction_of_B": a / b * (1 - idle)}
    return out


def format_figures(profile: Profile, figs: dict, held: Held | None = None) -> str:
    p = profile
    lines = [
        f"profile {p.name}: {p.description}",
        f"  {p.model.name} ({p.model.num_params / 1e9:.1f}B) | {p.cluster.num_rollout_gpus} rollout GPUs "
        f"({p.num_engines} engines, TP{p.rollout.tensor_parallel}) + {p.cluster.num_learner_gpus} "
        f"learner GPUs (DP{p.num_dp} x TP{p.learner.tensor_parallel} x PP{p.learner.pipeline_parallel})"
        f" | batch {p.workload.num_prompts_per_batch} x {p.workload.samples_per_prompt} | "
        f"K={p.schedules.max_group_slots if p.schedules.max_group_slots is not None else 'inf'} | "
        f"{p.run.num_steps} steps ({p.run.warmup_steps} warm-up), seed {p.run.seed}",
        "",
        f"{'schedule':<12}{'step s':>9}{'steps/GPU-h':>13}{'vs sync':>9}{'learner idle':>14}"
        f"{'rollout busy':>14}{'staleness':>11}",
    ]
    for name, s in figs["schedules"].items():
        lines.append(
            f"{name:<12}{s['step_s']:>9.1f}{s['steps_per_gpu_hour']:>13.4f}{s.get('vs_sync', np.nan):>9.3f}"
            f"{s['learner_idle_share']:>14.1%}{s['rollout_busy_share']:>14.1%}"
            f"{s['staleness_mean']:>6.2f}/{s['staleness_max']:<4.0f}")
    pub = figs["published"]
    lines += ["", *ledger_lines(p, held)]
    if "bound" in figs:
        b = figs["bound"]
        lines += [
            "",
            f"sync step: learner waits W = {b['W_s']:.1f} s for the last reward, then works "
            f"T = {b['T_s']:.1f} s",
            f"overlap bound B = (W + T) / max(W, T)              = {b['B']:.3f}",
        ]
    if "bound" in figs and "thunder_vs_sync" in figs["bound"]:
        b = figs["bound"]
        lines += [
            f"thunder / sync (steps per GPU-hour)                = {b['thunder_vs_sync']:.3f}"
            f"   -> {b['fraction_of_B']:.1%} of B",
            f"arrival bound (no backward before its reward)      = {b['B_arrival']:.3f}"
            f"   -> thunder at {b['fraction_of_B_arrival']:.1%} of it",
            f"thunder step = W + {b['thunder_after_last_reward_s']:.1f} s of learner work after the "
            f"last reward; its learner has nothing to do until the first reward, "
            f"{b['first_reward_s']:.1f} s into the step",
        ]
    lines += [
        f"published (seed paper): sync learners idle {pub['sync_learner_idle_share']:.1%}; 15 steps "
        f"vs 8 = {pub['thunder_vs_sync']:.3f} = {pub['fraction_of_B']:.1%} of B = "
        f"{pub['B_from_idle']:.3f}",
    ]
    return "\n".join(lines)


def ledger_lines(p: Profile, held: Held | None) -> list[str]:
    """What thunder's ledger holds and costs: held to the trainer config's plan, or (no trainer
    section) what it would need, unchecked."""
    k = p.schedules.max_group_slots
    buffer_gb = 4 * p.buffer_params / 1e9
    slots = f"K={k if k is not None else 'inf'} slots x {p.ledger.buffers_per_slot} {p.ledger.slot_dtype} buffers " \
            f"({p.ledger.placement})"
    sched = p.schedules
    extra = []
    if sched.pending_gradients:
        extra.append(f"pending buffers {sched.max_pending if sched.max_pending is not None else 'unbounded'}")
    if sched.per_turn_scores != "off":
        extra.append(f"per-turn {sched.per_turn_scores}, {sched.max_turn_streams or 'unbounded'} streams")
    head = f"thunder ledger: {slots}" + (f", {', '.join(extra)}" if extra else "") + \
        f"; one fp32 parameter-sized buffer per learner GPU: {buffer_gb:.1f} GB"
    if held is None or held.config is None:
        out = [head, "  memory NOT held to a layout (the profile has no trainer section): these buffers may not fit"]
    else:
        src = held.profile.trainer.config if held.profile.trainer is not None else None
        out = [head, f"  held to `megathunder plan` of {src or 'the default config'} + the profile's trainer overrides "
                     f"on {p.cluster.num_learner_gpus} x {p.cluster.gpu_memory_gb:g} GiB GPUs "
                     f"(queue policy {p.rollout.queue_policy}: rollout.engine.scheduling):"]
        out += [f"  {line}" for line in held.notes]
        out += [f"  {line}" for line in memory_lines(held)]
        if held.thunder_refused:
            out.append(f"  THUNDER NOT REPORTED: {held.thunder_refused}")
    c = Costs.of(p)
    if c.host:
        out.append(f"  costs per buffer: host write {c.write_block_s * 1e3:.0f} ms staging + {c.mover_s:.2f} s D2H and add "
                   f"({c.mover_pair_s:.2f} s for S and R {'from one copy' if c.paired else '(unpaired: twice ' + f'{c.mover_s:.2f} s)'}; "
                   f"{p.ledger.host_threads} add threads, chunks {p.ledger.host_chunk_mb:g} MiB), fold into P {c.fold_s:.2f} s, "
                   f"pending -> slot {c.slot_add_s:.2f} s; learner call {c.call_s * 1e3:.0f} ms")
    else:
        out.append(f"  costs per buffer: device write {c.write_block_s * 1e3:.0f} ms, fold {c.fold_s * 1e3:.0f} ms; "
                   f"learner call {c.call_s * 1e3:.0f} ms" + ("" if p.ledger.costs else " (buffer costs off)"))
    return out


def write_tables(traces: dict[str, Trace], figs: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for tr in traces.values() for r in metrics.step_table(tr)]
    steps = out / "steps.csv"
    with steps.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    ivs = out / "timeline.csv"
    with ivs.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["schedule", "lane", "start_s", "end_s", "kind", "step"])
        for name, tr in traces.items():
            writer.writerows([name, iv.lane, f"{iv.start:.3f}", f"{iv.end:.3f}", iv.kind, iv.step]
                        for iv in tr.intervals)
    summ = out / "summary.json"
    profile = next(iter(traces.values())).profile
    summ.write_text(json.dumps({"profile": profile.model_dump(mode="json"), **figs}, indent=2))
    return [steps, ivs, summ]


def plot_timeline(traces: dict[str, Trace], path: Path, num_steps: int = 2, max_lanes: int = 4) -> Path:
    """Profiler-trace-like lanes (learner ranks, rollout engines) for the first steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = traces.get("sync") or next(iter(traces.values()))
    t_max = ref.steps[min(num_steps, len(ref.steps)) - 1].end
    fig, axes = plt.subplots(len(traces), 1, figsize=(12, 1.0 + 1.1 * len(traces) * 1.6), sharex=True)
    axes = np.atleast_1d(axes)
    for ax, (name, tr) in zip(axes, traces.items(), strict=True):
        lanes = sorted({iv.lane for iv in tr.intervals},
                       key=lambda s: (not s.startswith("learner"),
                                      int(s.removeprefix("learner").removeprefix("rollout"))))
        shown = [ln for ln in lanes if ln.startswith("learner")][:max_lanes] + \
                [ln for ln in lanes if ln.startswith("rollout")][:max_lanes]
        y = {ln: i for i, ln in enumerate(reversed(shown))}
        for kind, color in COLORS.items():
            for ln in shown:
                spans = [(iv.start, iv.end - iv.start) for iv in tr.intervals
                         if iv.lane == ln and iv.kind == kind and iv.start < t_max]
                if spans:
                    ax.broken_barh(spans, (y[ln] - 0.4, 0.8), facecolors=color, linewidth=0)
        for st in tr.steps:
            if st.end <= t_max:
                ax.axvline(st.end, color="k", lw=0.6, ls=":")
        ax.set_yticks(list(y.values()), list(y.keys()), fontsize=7)
        ax.set_xlim(0, t_max)
        ax.set_title(f"{name}", fontsize=9, loc="left")
    axes[-1].set_xlabel("seconds (white = idle; dotted = weights published)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, list(COLORS), loc="upper right", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ratio(profile: Profile) -> tuple[float, float]:
    batches = sample_batches(profile, profile.run.num_steps)
    sync, thunder = run_sync(profile, batches), run_thunder(profile, batches)
    return metrics.zero_staleness_ratio(sync, thunder), metrics.overlap_bound(sync)["B"]


def sensitivity(profile: Profile, num_steps: int = 3) -> list[dict]:
    """thunder/sync and B as K, tail heaviness, tool latency and the GPU split vary."""
    base = profile.with_overrides({"run": {"num_steps": num_steps, "warmup_steps": 0}})
    wl = base.workload
    total = base.cluster.num_rollout_gpus + base.cluster.num_learner_gpus
    step = 2 * max(1, total // 16)
    sweeps: dict[str, list[tuple[object, dict]]] = {
        "K (group slots)": [(k if k is not None else "inf", {"schedules": {"max_group_slots": k}})
                            for k in (0, 1, 2, 4, 8, 16, None)],
        "tail: sigma of log(turns)": [
            (s, {"workload": {"turns": {"sigma": s}}}) for s in (0.2, 0.4, 0.6, 0.8, 1.0)],
        "tool latency x": [
            (f, {"workload": {"tool_latency_s": wl.tool_latency_s.scaled(f).model_dump()}})
            for f in (0.25, 0.5, 1.0, 2.0, 4.0)],
        "learner GPUs of total (TP2 each side)": [
            (n, {"cluster": {"num_learner_gpus": n, "num_rollout_gpus": total - n},
                 "learner": {"tensor_parallel": 2, "pipeline_parallel": 1},
                 "rollout": {"tensor_parallel": 2}})
            for n in range(step, total, step)],
    }
    rows = []
    for sweep, points in sweeps.items():
        for value, upd in points:
            ratio, B = _ratio(base.with_overrides(upd))
            rows.append({"sweep": sweep, "value": value, "thunder_vs_sync": ratio, "B": B})
    return rows


def plot_sensitivity(rows: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = list(dict.fromkeys(r["sweep"] for r in rows))
    fig, axes = plt.subplots(1, len(sweeps), figsize=(4 * len(sweeps), 3.4), sharey=True)
    for ax, sw in zip(np.atleast_1d(axes), sweeps, strict=True):
        rs = [r for r in rows if r["sweep"] == sw]
        x = np.arange(len(rs))
        ax.plot(x, [r["thunder_vs_sync"] for r in rs], "o-", label="thunder / sync")
        ax.plot(x, [r["B"] for r in rs], "k--", lw=1, label="bound B")
        ax.set_xticks(x, [str(r["value"]) for r in rs])
        ax.set_xlabel(sw)
        ax.axhline(1, color="gray", lw=0.5)
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("steps per GPU-hour vs sync")
    np.atleast_1d(axes)[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def last_line(profile: Profile, figs: dict, held: Held | None = None) -> str:
    """The CLI's final JSON line: per schedule, learner idle share and steps per GPU-hour; the
    ledger in force (K, pending buffers, placement) and, when it was refused, why thunder was."""
    sched = profile.schedules
    out: dict = {"profile": profile.name,
           "ledger": {"K": sched.max_group_slots, "pending": sched.max_pending if sched.pending_gradients else 0,
                      "per_turn": sched.per_turn_scores, "placement": profile.ledger.placement,
                      "slot_dtype": profile.ledger.slot_dtype,
                      "held_to_plan": held is not None and held.config is not None},
           "thunder_refused": held.thunder_refused if held is not None else None,
           "schedules": {n: {"learner_idle_share": round(s["learner_idle_share"], 4),
                             "steps_per_gpu_hour": round(s["steps_per_gpu_hour"], 5)}
                         for n, s in figs["schedules"].items()}}
    if "bound" in figs:
        out.update({k: round(figs["bound"][k], 4) for k in
                    ("thunder_vs_sync", "B", "fraction_of_B", "B_arrival", "fraction_of_B_arrival")
                    if k in figs["bound"]})
    return json.dumps(out)


CALIBRATION_TOLERANCE = 0.15  # the calibration target: predicted step time within 15% of the measured one


def format_calibration(results: list[dict]) -> str:
    """Predicted vs measured per run (turns replayed; and with the fitted decode rates), then the
    fitted inputs of each."""
    lines = [(f"{'run':<26}{'schedule':<12}{'steps':>6}{'measured s':>11}{'predicted s':>12}{'error':>8}"
              f"{'idle meas':>10}{'idle pred':>10}{'| decode model s':>17}{'error':>8}")]
    for r in results:
        flag = "" if abs(r["error"]) <= CALIBRATION_TOLERANCE else "  > 15%"
        lines.append(f"{_short(r['run']):<26}{r['schedule']:<12}{r['steps']:>6}{r['measured_step_s']:>11.2f}"
                     f"{r['predicted_step_s']:>12.2f}{r['error']:>+8.1%}{r['measured_learner_idle']:>10.1%}"
                     f"{r['predicted_learner_idle']:>10.1%}{r['model_step_s']:>17.2f}{r['model_error']:>+8.1%}{flag}")
    lines.append("\nfitted inputs (decode model: [concurrency, aggregate tokens/s]):")
    for r in results:
        f = r["fitted"]
        table = " ".join(f"[{c:.0f}, {a:.0f}]" for c, a in f["decode_tokens_per_s"])
        lines.append(f"  {_short(r['run'])}: turn generating {f['generate_s_mean']:.3f} s (mean) | decode {table}"
                     f" | learner {f['learner_seconds_per_token'] * 1e3:.3f} ms/token | step {f['optimizer_step_s']:.3f} s"
                     f" | weight sync {f['weight_sync_s']:.3f} s ({f['weight_sync_learner_s']:.3f} s learner)"
                     f" | between turns {f['tool_gap_s_mean']:.3f} s | verifier {f['verifier_s_mean']:.3f} s")
    return "\n".join(lines)


def _short(path: str) -> str:
    return "/".join(Path(path).parts[-2:])


def write_profile(profile: Profile, out: Path) -> Path:
    """The fitted profile as YAML: ``megathunder simulate`` runs it on freshly sampled batches."""
    import yaml

    path = out / f"{profile.name}.yaml"
    path.write_text(yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False))
    return path


def calibration_last_line(results: list[dict]) -> str:
    keys = ("run", "schedule", "measured_step_s", "predicted_step_s", "error", "measured_learner_idle",
            "predicted_learner_idle", "model_step_s", "model_error")
    runs = [{k: round(float(r[k]), 4) if isinstance(r[k], float) else r[k] for k in keys} for r in results]
    worst = float(max(abs(r["error"]) for r in results))  # numpy scalars from the replay: plain for json
    return json.dumps({"calibration": runs, "max_abs_error": round(worst, 4),
                       "within_tolerance": worst <= CALIBRATION_TOLERANCE})
