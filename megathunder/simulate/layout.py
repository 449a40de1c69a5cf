"""The simulation held to the layout: what the trainer config's ``megathunder plan`` lets thunder hold.

A profile with a ``trainer`` section simulates that megathunder config on the profile's GPUs. The
config decides the learner layout (TP, PP, DP = learner GPUs / (TP x PP)), the batch shape, the
longest trajectory, the rollout engine's scheduling and every ledger setting: K
(``ledger.max_group_slots`` within ``slot_budget_gb``), the slots' dtype and placement, pending
buffers and per-turn streams. The profile keeps the workload's distributions, the engines' rates,
the learner's MFU and the hardware's link rates.

What fits is the plan's arithmetic, the same ``megathunder plan`` the launch runs first, for the
most loaded rank of the layout on GPUs of ``cluster.gpu_memory_gb`` and nodes of
``cluster.host_memory_gb``:

1. The layout without the ledger (``schedule.mode=sync``) must fit, or nothing is simulated
   (``LayoutError`` names what does not fit): no schedule can run there.
2. The thunder layout as configured. If it does not fit, the ledger's buffers are what make it
   not fit (step 1 fitted), so they are lowered, cheapest loss first, until the plan fits: per-turn
   streams (each keeps a trajectory's segment graphs), then pending buffers, then K. Each is
   lowered to the largest value that fits (a bisection: the plan's memory grows with each of them).
   The figure reported is then thunder's *at that K*, with a line naming what did not fit and what
   was simulated instead. (We report the lowered K rather than refusing: a run with the config as
   shipped would stop at the plan's preflight, and the lowered setting is what the operator would
   run; the line says so.)
3. If even K = 0 without pending buffers or streams does not fit (P alone, the accumulator every
   thunder batch needs), thunder is refused: ``Held.thunder_refused`` says why, and no thunder
   figure is printed.

The buffer a ledger operation moves is one parameter-sized buffer of that most loaded rank
(``Plan.stage``): ``LedgerSpec.buffer_params``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megathunder.config import Config, ConfigError, RLObjective, load_config
from megathunder.plan.memory_plan import GiB, Machine, ModelShape, Plan, plan, stage_params
from megathunder.plan.plan_cmd import model_shape
from megathunder.simulate.profile import Profile

REPO = Path(__file__).resolve().parents[2]
QUEUE_POLICY = {"fifo": "fifo", "trajectory_start": "oldest_first", "group_aware": "group_aware"}
"""``rollout.engine.scheduling`` -> the simulator's queue policy (``rollout_model``)."""
TURN_STRATEGIES = ("kv_adjoint", "forward_early")  # per-turn strategies the simulator models


class LayoutError(ConfigError):
    """The layout does not fit even without the ledger, or the trainer config is invalid."""


@dataclass
class Held:
    """A profile held to its trainer config's layout."""

    profile: Profile
    notes: list[str] = field(default_factory=list)  # what the plan changed, one line each
    thunder_refused: str | None = None  # why no thunder figure (nothing of the ledger fits)
    plan: Plan | None = None  # the thunder plan that fits (or sync's, when refused)
    config: Config | None = None


def config_path(path: str | None) -> Path | None:
    """A config path as given, else relative to the repository (bundled profiles name shipped ones)."""
    if path is None:
        return None
    p = Path(path)
    if p.is_file() or p.is_absolute():
        return p
    return REPO / p


def trainer_config(profile: Profile, extra: list[str] | tuple[str, ...] = ()) -> Config:
    """The profile's trainer config, with ``extra`` overrides after its own."""
    assert profile.trainer is not None
    try:
        t = profile.trainer
        return load_config(config_path(t.config), [*t.model, *t.overrides, *extra])
    except ConfigError as err:
        raise LayoutError(f"trainer config: {err}") from None


def machine_of(profile: Profile) -> Machine:
    c = profile.cluster
    return Machine(gpu_memory_gb=c.gpu_memory_gb, ranks_per_node=c.gpus_per_node, host_memory_gb=c.host_memory_gb,
                   world=c.num_learner_gpus)


def shape_of(cfg: Config) -> ModelShape:
    """The policy's shape: its config.json when the config names one, else ``learner.model``'s sizes."""
    return model_shape(cfg, "run" if cfg.learner.model.hf_checkpoint is not None else "config")


def hold(profile: Profile) -> Held:
    """``profile`` with its trainer config's layout, batch, scheduling and fitted ledger (module
    docstring); unchanged without a ``trainer`` section."""
    if profile.trainer is None:
        return Held(profile)
    base = trainer_config(profile)
    shape, machine = shape_of(base), machine_of(profile)
    sync_plan = plan(trainer_config(profile, ["schedule.mode=sync"]), shape, machine)
    if not sync_plan.feasible:
        raise LayoutError("the layout does not fit even without thunder's ledger: " + "; ".join(sync_plan.problems))
    rl = base.objective if isinstance(base.objective, RLObjective) else None
    if base.schedule.mode != "thunder" or rl is None:
        raise LayoutError(f"trainer config: schedule.mode={base.schedule.mode}, objective.kind={base.objective.kind}: "
                          "the simulator models GRPO under thunder (set schedule.mode=thunder, a GRPO objective)")
    held = Held(profile, config=base)
    fitted, notes = fit_ledger(profile, base, shape, machine)
    held.notes += notes
    if fitted is None:
        held.thunder_refused = notes[-1]
        held.plan = sync_plan
        held.profile = profile.with_overrides(_derived(profile, base, shape, sync_plan, {}))
        return held
    cfg, thunder_plan = fitted
    held.plan, held.config = thunder_plan, cfg
    held.profile = profile.with_overrides(_derived(profile, cfg, shape, thunder_plan, _ledger_fields(cfg, rl, thunder_plan)))
    return held


def fit_ledger(profile: Profile, cfg: Config, shape: ModelShape, machine: Machine
               ) -> tuple[tuple[Config, Plan] | None, list[str]]:
    """The config with turn streams, pending buffers and K lowered, in that order, until the plan
    fits (module docstring, step 2); None when nothing of the ledger fits (step 3). Returns the
    lines that say what was lowered."""
    notes: list[str] = []
    first = plan(cfg, shape, machine)
    if first.feasible:
        return (cfg, first), notes
    notes.append(f"as configured, thunder does not fit: {'; '.join(first.problems)}")
    overrides: list[str] = []
    led = cfg.ledger
    knobs: list[tuple[str, int, str]] = []  # (field, current value, what it holds)
    if led.per_turn_scores in TURN_STRATEGIES:
        knobs.append(("ledger.max_turn_streams", _turn_streams(cfg), "per-turn streams (retained segment graphs)"))
    if led.max_pending != 0:
        knobs.append(("ledger.max_pending", _pending(cfg, first), "pending buffers"))
    knobs.append(("ledger.max_group_slots", first.ledger_slots if first.ledger_slots is not None
                  else cfg.batch.num_prompts_per_batch, "group slots K"))
    for name, current, what in knobs:
        best = _largest_fitting(profile, overrides, name, current, shape, machine)
        if best is None:
            overrides.append(_off(name))
            notes.append(f"{what}: not even one fits; off" if name != "ledger.max_group_slots"
                         else f"{what}: not even one fits; K = 0 (group-level streaming) simulated")
            continue
        overrides.append(f"{name}={best}")
        notes.append(f"{what}: {current} do not fit; {best}, the most that fits, simulated")
        break
    final = trainer_config(profile, overrides)
    result = plan(final, shape, machine)
    if not result.feasible:
        return None, [*notes, "thunder refused: its accumulator P does not fit beside the layout even at K = 0 "
                              f"({'; '.join(result.problems)})"]
    return (final, result), notes


def _off(name: str) -> str:
    """The setting that removes a knob's buffers: no streams, no pending buffers, K = 0."""
    return {"ledger.max_turn_streams": "ledger.per_turn_scores=off", "ledger.max_pending": "ledger.max_pending=0",
            "ledger.max_group_slots": "ledger.max_group_slots=0"}[name]


def _largest_fitting(profile: Profile, fixed: list[str], name: str, current: int, shape: ModelShape,
                     machine: Machine) -> int | None:
    """The largest value in [1, current - 1] (or current, if it fits with ``fixed``) of ``name``
    whose plan fits, by bisection (memory grows with it); None when not even 1 fits."""
    def fits(value: int) -> bool:
        return plan(trainer_config(profile, [*fixed, f"{name}={value}"]), shape, machine).feasible

    lo, hi = 0, max(current, 0)
    if hi >= 1 and fits(hi):
        return hi
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo or None


def _turn_streams(cfg: Config) -> int:
    """Streams the plan counts (``memory_plan._turn_stream_lines``)."""
    led = cfg.ledger
    bounds = [cfg.agent.max_concurrent_episodes, cfg.batch.num_prompts_per_batch * cfg.batch.samples_per_prompt]
    bounds += [b for b in (led.max_turn_streams, led.max_pending) if b is not None]
    return min(bounds)


def _pending(cfg: Config, p: Plan) -> int:
    """Pending buffers the plan counts: its line's count (a budget's rest, a cap, or one per trajectory)."""
    for line in p.lines:
        if line.part == "ledger pending":
            return int(line.note.split("max_pending = ")[1].split()[0])
    return cfg.batch.num_prompts_per_batch * cfg.batch.samples_per_prompt


def _ledger_fields(cfg: Config, rl: RLObjective, p: Plan) -> dict[str, Any]:
    """The profile's ``schedules`` and ``ledger`` settings from a config that fits."""
    from megathunder.objectives import coef_known_before_close

    led = cfg.ledger
    per_slot = 1 if coef_known_before_close(rl) and not led.hold_groups_until_close else 2
    streams = led.per_turn_scores in TURN_STRATEGIES
    pending = led.max_pending != 0 or streams
    cap = None
    if pending:  # as many as the plan fits (none: the budget left no room beside K slots)
        cap = next((int(line.note.split("max_pending = ")[1].split()[0]) for line in p.lines
                    if line.part == "ledger pending"), 0)
        if cap == 0:
            pending = streams = False
    return {
        "schedules": {"max_group_slots": p.ledger_slots, "pending_gradients": pending, "max_pending": cap,
                      "per_turn_scores": led.per_turn_scores if streams else "off",
                      "max_turn_streams": _turn_streams(cfg) if streams else None,
                      "skip_zero_advantage": rl.skip_zero_advantage and not rl.has_reward_free_terms,
                      "defer_uniform_groups": led.defer_uniform_groups},
        "ledger": {"placement": led.slot_placement, "slot_dtype": "bfloat16" if led.slot_dtype == "bfloat16" else "float32",
                   "buffers_per_slot": per_slot, "host_threads": led.host_threads,
                   "host_chunk_mb": led.host_chunk_mb, "pack_own_passes": led.pack_own_passes},
    }


def _derived(profile: Profile, cfg: Config, shape: ModelShape, p: Plan, ledger: dict[str, Any]) -> dict[str, Any]:
    """The profile fields the config decides (module docstring)."""
    par = cfg.learner.parallel
    stage_p = sum(stage_params(shape, par.tensor_parallel, par.pipeline_parallel, p.stage, par.expert_parallel,
                               par.expert_tensor_parallel_size))
    full = cfg.learner.activations.recompute == "full"
    out: dict[str, Any] = {
        "model": {"num_params": float(shape.num_params), "num_layers": shape.layers, "hidden_size": shape.hidden},
        "learner": {"tensor_parallel": par.tensor_parallel, "pipeline_parallel": par.pipeline_parallel,
                    "flops_per_param_token": 8.0 if full else 6.0},
        "rollout": {"queue_policy": QUEUE_POLICY[cfg.rollout.engine.scheduling]},
        "workload": {"num_prompts_per_batch": cfg.batch.num_prompts_per_batch,
                     "samples_per_prompt": cfg.batch.samples_per_prompt,
                     "max_context_tokens": min(profile.workload.max_context_tokens, cfg.agent.max_total_tokens)},
        "ledger": {"buffer_params": float(stage_p)},
    }
    for section, values in ledger.items():
        out[section] = {**out.get(section, {}), **values}
    return out


def memory_lines(held: Held) -> list[str]:
    """The plan's ledger lines and totals per learner GPU, for the report."""
    p = held.plan
    if p is None:
        return []
    lines = [f"{line.part}: {line.device / GiB:.1f} GiB on the GPU, {line.host / GiB:.1f} GiB host ({line.note})"
             for line in p.lines if line.part.startswith("ledger") or line.part == "turn streams"]
    lines.append(f"per learner GPU (stage {p.stage}): {p.device_total / GiB:.1f} GiB of "
                 f"{held.profile.cluster.gpu_memory_gb:g}; per node host: {p.node_host_total / GiB:.0f} GiB of "
                 f"{held.profile.cluster.host_memory_gb:g}")
    return lines
