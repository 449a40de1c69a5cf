"""A workload profile: every timing the simulator needs, typed and validated when parsed.

A profile is a YAML file (bundled ones live in ``megathunder/simulate/profiles/``). It may start
with ``extends: NAME`` to inherit another profile and change a few fields. Units are in the
field names (``_s`` seconds, ``_tokens``, ``_per_s``). Calibration against real runs replaces
the FLOPs/roofline estimates here with measured values; the fields that take measurements are
marked "calibration:" below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from megathunder.config.loader import ConfigError, _format, _merge, parse_overrides

PROFILE_DIR = Path(__file__).with_name("profiles")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Dist(_Strict):
    """A positive random quantity: lognormal (median, sigma), constant, or empirical (values)."""

    kind: Literal["lognormal", "constant", "empirical"] = "lognormal"
    median: float | None = Field(None, gt=0)
    """lognormal: the median, exp(mu)."""
    sigma: float = Field(0.0, ge=0)
    """lognormal: standard deviation of the log; the tail heaviness."""
    value: float | None = Field(None, ge=0)
    """constant: the value."""
    values: list[float] | None = None
    """empirical: samples drawn with replacement (e.g. measured from real trajectories)."""
    min: float = Field(0.0, ge=0)
    max: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> Dist:
        need = {"lognormal": "median", "constant": "value", "empirical": "values"}[self.kind]
        if getattr(self, need) is None or (self.kind == "empirical" and not self.values):
            raise ValueError(f"{need}: required when kind is {self.kind}")
        if self.max is not None and self.max < self.min:
            raise ValueError("max: must be >= min")
        return self

    def sample(self, rng: np.random.Generator, n: int, z: np.ndarray | None = None) -> np.ndarray:
        """n draws; ``z`` (standard normals) replaces the lognormal's own draws when given."""
        if self.kind == "constant":
            assert self.value is not None  # checked by the validator
            x = np.full(n, float(self.value))
        elif self.kind == "empirical":
            x = rng.choice(np.asarray(self.values, dtype=float), size=n)
        else:
            z = rng.standard_normal(n) if z is None else z
            assert self.median is not None  # checked by the validator
            x = float(self.median) * np.exp(self.sigma * z)
        return np.clip(x, self.min, self.max if self.max is not None else np.inf)

    @classmethod
    def fit(cls, samples, kind: Literal["lognormal", "empirical"] = "lognormal") -> Dist:
        """Calibration: a lognormal fitted to measured values (median and sigma of the logs,
        clipped to their range), or the values themselves."""
        x = np.asarray(samples, dtype=float)
        if x.size == 0 or (x < 0).any():
            raise ValueError("samples: need at least one value, none negative")
        if kind == "empirical":
            return cls(kind="empirical", values=x.tolist())
        logs = np.log(x[x > 0])
        return cls(kind="lognormal", median=float(np.exp(logs.mean())), sigma=float(logs.std()),
                   min=float(x.min()), max=float(x.max()))

    def scaled(self, factor: float) -> Dist:
        """The same shape with every value multiplied by ``factor``."""
        upd: dict[str, Any] = {"min": self.min * factor}
        if self.max is not None:
            upd["max"] = self.max * factor
        if self.median is not None:
            upd["median"] = self.median * factor
        if self.value is not None:
            upd["value"] = self.value * factor
        if self.values is not None:
            upd["values"] = [v * factor for v in self.values]
        return self.model_copy(update=upd)


class ModelSpec(_Strict):
    name: str = "model"
    num_params: float = Field(gt=0)
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)


class ClusterSpec(_Strict):
    gpu: str = "gpu"
    num_rollout_gpus: int = Field(ge=1)
    num_learner_gpus: int = Field(ge=1)
    peak_flops_per_gpu: float = Field(gt=0)
    """Dense bf16 peak, FLOP/s."""
    gpu_memory_gb: float = Field(80.0, gt=0)
    """GiB of one learner GPU: what ``megathunder plan`` holds the layout to (``trainer``)."""
    host_memory_gb: float = Field(2048.0, gt=0)
    """GiB of host memory per learner node (host-placed ledger slots live there)."""
    gpus_per_node: int = Field(8, ge=1)
    """Learner ranks per node (they share the node's host memory)."""


class RolloutSpec(_Strict):
    """vLLM engines with continuous batching: every decoding sequence of an engine advances at
    ``decode_tokens_per_s(c) / c`` tokens/s, where c is the number decoding on it now."""

    tensor_parallel: int = Field(1, ge=1)
    """GPUs per engine; engines = num_rollout_gpus / tensor_parallel."""
    max_num_seqs: int = Field(ge=1)
    """Sequences decoding at once per engine (KV-cache bound); the rest wait in a FIFO."""
    decode_tokens_per_s: list[tuple[float, float]]
    """Calibration: [concurrency, aggregate decode tokens/s of one engine] points, interpolated
    linearly, flat beyond the last point."""
    prefill_tokens_per_s: float = Field(gt=0)
    """Prompt and tool-output tokens are prefilled at this rate (a delay before decoding)."""
    queue_policy: Literal["fifo", "oldest_first", "most_turns_first", "group_aware"] = "fifo"
    """Order in which waiting turns get a decoding slot: arrival order (vLLM's default), the
    trajectory's start order (``oldest_first``: the trainer's ``rollout.engine.scheduling=
    trajectory_start``), most turns done first, or the group with the fewest members still
    generating first (``group_aware``, as in the trainer). The non-FIFO ones are vLLM's priority
    scheduling with the priority ``megathunder.rollout.priority`` gives."""

    @model_validator(mode="after")
    def _check(self) -> RolloutSpec:
        pts = self.decode_tokens_per_s
        if not pts or any(c < 1 or r <= 0 for c, r in pts):
            raise ValueError("decode_tokens_per_s: needs points [concurrency >= 1, tokens/s > 0]")
        if any(b[0] <= a[0] for a, b in zip(pts, pts[1:], strict=False)):
            raise ValueError("decode_tokens_per_s: concurrencies must increase")
        return self

    def per_seq_rates(self) -> np.ndarray:
        """rates[c] = tokens/s of each of c sequences decoding together (rates[0] = 0)."""
        c = np.arange(self.max_num_seqs + 1, dtype=float)
        xs, ys = zip(*self.decode_tokens_per_s, strict=True)
        agg = np.interp(c, xs, ys)
        rates = np.zeros_like(c)
        rates[1:] = agg[1:] / c[1:]
        return rates


class LearnerSpec(_Strict):
    """Megatron learner: trajectories are the microbatches, FLOPs-based cost per trajectory."""

    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)
    mfu: float = Field(0.4, gt=0, le=1)
    """Calibration: model FLOPs utilisation of forward+backward."""
    flops_per_param_token: float = Field(6.0, gt=0)
    """6 = forward + backward; 8 with full activation recomputation."""
    seconds_per_token: float | None = Field(None, gt=0)
    """Calibration: measured forward+backward seconds per token on one data-parallel replica;
    when set it replaces the FLOPs model (attention's L^2 term is then not added)."""
    optimizer_step_s: float = Field(ge=0)
    """Calibration: DP gradient reduce + clip + optimizer step, seconds."""
    weight_sync_s: float = Field(ge=0)
    """Calibration: reshard and push the weights into every rollout engine, seconds."""
    weight_sync_learner_s: float | None = Field(None, ge=0)
    """Calibration: the learner's own part of ``weight_sync_s`` (gather and reshard, scoring the
    probe); the rest is the engines' (loading, sampling the probe). null: all of it. Changes only
    the learner's busy time, not when the weights are live."""
    layerwise_overlap: bool = True
    """Overlap the optimizer and the weight push layer by layer with the last backward."""
    max_microbatches_per_burst: int = Field(64, ge=1)
    """Streaming: the most ready trajectories a data-parallel rank takes into one pipeline burst."""
    call_overhead_s: float = Field(0.0, ge=0)
    """Calibration: the fixed cost of one learner schedule call (set-up, Python, launches, the
    pipeline's first/last send), on top of its trajectories' work: the intercept of call seconds
    regressed on call size (``megathunder.simulate.call_cost``: from ``megathunder bench learner``'s
    figures or a run's trace). Every call pays it: sync's one per rank, thunder's one per
    slot-path or pending trajectory, per packed release of closed groups and per turn."""

    @property
    def push_busy_s(self) -> float:
        """Seconds of each weight sync the learner itself is busy."""
        own = self.weight_sync_s if self.weight_sync_learner_s is None else self.weight_sync_learner_s
        return min(own, self.weight_sync_s)


class WorkloadSpec(_Strict):
    """One GRPO batch: num_prompts_per_batch groups of samples_per_prompt trajectories."""

    num_prompts_per_batch: int = Field(ge=1)
    samples_per_prompt: int = Field(ge=1)
    prompt_tokens: Dist
    turns: Dist
    """Model turns per trajectory (rounded; >= 1)."""
    prompt_difficulty_share: float = Field(0.0, ge=0, le=1)
    """Share of log(turns) variance common to a group (hard prompts make long groups)."""
    tokens_per_turn: Dist
    """Tokens the model generates per turn."""
    observation_tokens_per_turn: Dist
    """Tool-output tokens appended after each turn but the last."""
    tool_latency_s: Dist
    """Sandbox time of one tool call."""
    verifier_latency_s: Dist
    """Time from a trajectory's end to its reward (running the tests)."""
    max_context_tokens: int = Field(ge=1)
    """A trajectory stops when its context would exceed this (SWE-agent's exit_context)."""
    solve_rate: float | None = Field(None, ge=0, le=1)
    """Binary rewards: the share of trajectories rewarded 1 (the rest 0). What the ledger's work
    depends on: a trajectory whose reward equals its slot's shift writes S alone, a group whose
    rewards are all equal has every advantage 0 (``skip_zero_advantage``). null: every reward in
    a group distinct (each writes S and R; no advantage is 0)."""
    solve_prompt_share: float = Field(0.0, ge=0, lt=1)
    """With ``solve_rate``: share of the solving latent common to a group (a Gaussian copula):
    hard tasks fail whole groups, easy ones pass them."""

    @property
    def batch_size(self) -> int:
        return self.num_prompts_per_batch * self.samples_per_prompt


class ScheduleSpec(_Strict):
    max_group_slots: int | None = Field(None, ge=0)
    """thunder: the ledger's K; null = a slot for every group (full per-trajectory streaming)."""
    max_staleness: int = Field(2, ge=1)
    """fully_async: a trajectory may start at most this many versions ahead of the learner."""
    max_in_flight_prompts: int | None = Field(None, ge=1)
    """fully_async: groups in flight at once; null = num_prompts_per_batch."""
    pending_gradients: bool = False
    """thunder: each trajectory's score gradient when it finishes, while its verifier runs
    (``ledger.max_pending: null``); its reward only folds it in."""
    per_turn_scores: Literal["off", "kv_adjoint", "forward_early"] = "off"
    """thunder (``ledger.per_turn_scores``; implies pending buffers): kv_adjoint runs each turn's
    forward and own-loss backward when the turn ends and the K/V adjoint sweep (a backward through
    every earlier segment) at the finish; forward_early runs each turn's forward when it ends and
    the one backward at the finish."""
    max_pending: int | None = Field(None, ge=0)
    """With ``pending_gradients``: pending buffers per learner rank (``ledger.max_pending`` as
    ``megathunder plan`` fits it); a trajectory finding none free takes the reward-time path.
    null: one per trajectory."""
    max_turn_streams: int | None = Field(None, ge=0)
    """With ``per_turn_scores``: trajectories streamed by turns at once per learner rank (their
    retained graphs, ``ledger.max_turn_streams`` as the plan fits it); the rest take the finish-time
    path. null: unbounded."""
    skip_zero_advantage: bool = False
    """Every schedule: a trajectory whose advantage is 0 (its group's rewards all equal, with
    ``workload.solve_rate``) and whose loss has no reward-free term contributes exactly 0 to the
    gradient, so no forward or backward runs for it (``objective.skip_zero_advantage``). thunder
    knows A_i only once its group closes: a trajectory already in a slot or a pending buffer has
    run."""
    defer_uniform_groups: bool = False
    """thunder: a group takes a slot only once two of its rewards differ (``ledger.
    defer_uniform_groups``); until then its rewarded trajectories wait as data, and a group that
    closes with all rewards equal runs none of them. Only with ``skip_zero_advantage`` (as in the
    ledger: otherwise it would only delay their passes)."""
    hold_while_generating: bool = False
    """thunder: no learner work starts while a rollout engine decodes; what is ready waits for the
    engines to go idle (tool calls, verifiers, the batch's end). The trainer's
    ``ledger.hold_while_generating: in_process``: an in-process engine on the learner's own cores
    (calibration sets it from the run's config)."""
    async_push_overlaps_training: bool = True
    """async: the learner trains the next batch while it pushes the new weights (a copy, over its
    own link); false: the push (gather, load into the engines, probe) completes first, as
    megathunder's trainer does."""


class LedgerSpec(_Strict):
    """Where thunder's slot and pending buffers live and what each operation on them costs on one
    learner rank (``megathunder.simulate.ledger_model``). Derived from the trainer config when the
    profile has one (``trainer``); the rates are the hardware's (``buffers``)."""

    placement: Literal["device", "host"] = "device"
    """``ledger.slot_placement``."""
    slot_dtype: Literal["float32", "bfloat16"] = "float32"
    """``ledger.slot_dtype`` (gradient = fp32 on the Megatron learner)."""
    buffers_per_slot: int = Field(2, ge=1, le=2)
    """S and R (2), or S alone for std-free advantages (1)."""
    buffer_params: float | None = Field(None, gt=0)
    """Parameters of one rank's buffer (its stage's TP shard, from the plan); null: num_params /
    (tensor_parallel x pipeline_parallel)."""
    host_threads: int = Field(1, ge=1)
    """``ledger.host_threads``: threads adding into host slots, each a chunk of every add."""
    host_chunk_mb: float = Field(0.0, ge=0)
    """``ledger.host_chunk_mb``: a host write's D2H goes in chunks of this size, each added while
    the next is on the wire (0: one transfer, then the add)."""
    paired_writes: bool = True
    """A slot-path h_i goes down once for both S and R (the ledger's ``slot_write_pair``); false:
    once per buffer, the second waiting for the first (the ledger before it)."""
    pack_own_passes: bool = True
    """``ledger.pack_own_passes``: slot- and pending-path passes ready at once share one call
    (pipelined: m of them cost (m + PP - 1) / m of their work); false: each its own call (PP x its
    work)."""
    costs: bool = True
    """Model the buffer operations' time; false: free (calibration: the measured learner seconds
    hold them)."""


class BufferCostSpec(_Strict):
    """Rates of the learner node's links and memories (estimates until measured: the host add by
    ``megathunder bench hostadd``, the PCIe copies by the same on a GPU)."""

    d2h_gb_per_s: float = Field(25.0, gt=0)
    """Pinned device-to-host copy, GB/s per GPU with every GPU of the node copying."""
    h2d_gb_per_s: float = Field(25.0, gt=0)
    """Pinned host-to-device copy, GB/s per GPU."""
    device_gb_per_s: float = Field(2000.0, gt=0)
    """Device memory traffic of a copy or an add (bytes read + written per second)."""
    host_add_elements_per_s: list[tuple[float, float]] = [(1.0, 1.0e9)]
    """Calibration: [threads, fp32 elements added per second] of one rank's ``add_`` into a host
    buffer (every rank of the node adding at once), interpolated, flat beyond the last point."""

    @model_validator(mode="after")
    def _check(self) -> BufferCostSpec:
        pts = self.host_add_elements_per_s
        if not pts or any(n < 1 or r <= 0 for n, r in pts):
            raise ValueError("host_add_elements_per_s: needs points [threads >= 1, elements/s > 0]")
        if any(b[0] <= a[0] for a, b in zip(pts, pts[1:], strict=False)):
            raise ValueError("host_add_elements_per_s: threads must increase")
        return self

    def host_add_rate(self, threads: int) -> float:
        """fp32 elements per second one rank adds with ``threads`` threads."""
        xs, ys = zip(*self.host_add_elements_per_s, strict=True)
        return float(np.interp(threads, xs, ys))


class TrainerSpec(_Strict):
    """The megathunder config whose learner layout the simulation is held to: its ``megathunder
    plan`` decides the ledger's K, pending buffers and turn streams that fit (``layout.py``), and
    it sets the layout, the batch, the ledger's placement and the engine's scheduling."""

    config: str | None = None
    """A config file (relative to the working directory or the repository), or null: the defaults."""
    model: list[str] = []
    """``learner.model.*`` overrides: the sizes of the policy the workload is for, over the config
    file's (with ``learner.model.hf_checkpoint=null``, so these sizes are the ones planned); kept by
    ``megathunder simulate --config``."""
    overrides: list[str] = []
    """``key=value`` overrides of the config (``trainer.KEY=VALUE`` on the command line appends one;
    ``megathunder simulate --config`` replaces them)."""


class RunSpec(_Strict):
    num_steps: int = Field(6, ge=1)
    warmup_steps: int = Field(1, ge=0)
    """Steps left out of the rates (async pipelines fill during them)."""
    seed: int = 0


class Profile(_Strict):
    name: str = "profile"
    description: str = ""
    model: ModelSpec
    cluster: ClusterSpec
    rollout: RolloutSpec
    learner: LearnerSpec
    workload: WorkloadSpec
    schedules: ScheduleSpec = ScheduleSpec()
    ledger: LedgerSpec = LedgerSpec()
    buffers: BufferCostSpec = BufferCostSpec()
    trainer: TrainerSpec | None = None
    run: RunSpec = RunSpec()

    @model_validator(mode="after")
    def _check(self) -> Profile:
        c, r, lrn = self.cluster, self.rollout, self.learner
        if c.num_rollout_gpus % r.tensor_parallel:
            raise ValueError("cluster.num_rollout_gpus: must be a multiple of rollout.tensor_parallel")
        if c.num_learner_gpus % (lrn.tensor_parallel * lrn.pipeline_parallel):
            raise ValueError("cluster.num_learner_gpus: must be a multiple of learner "
                             "tensor_parallel * pipeline_parallel")
        if self.run.warmup_steps >= self.run.num_steps:
            raise ValueError("run.warmup_steps: must be < run.num_steps")
        return self

    @property
    def num_engines(self) -> int:
        return self.cluster.num_rollout_gpus // self.rollout.tensor_parallel

    @property
    def num_dp(self) -> int:
        replica = self.learner.tensor_parallel * self.learner.pipeline_parallel
        return self.cluster.num_learner_gpus // replica

    @property
    def num_gpus(self) -> int:
        return self.cluster.num_rollout_gpus + self.cluster.num_learner_gpus

    @property
    def buffer_params(self) -> float:
        """Parameters of one learner rank's parameter-sized buffer."""
        if self.ledger.buffer_params is not None:
            return self.ledger.buffer_params
        return self.model.num_params / (self.learner.tensor_parallel * self.learner.pipeline_parallel)

    def with_overrides(self, overrides: dict[str, Any]) -> Profile:
        """A validated copy with a nested dict of changes merged in."""
        return _validate(_merge(self.model_dump(), overrides), self.name)


def bundled_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def _read(name_or_path: str | Path, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError(f"profile {str(name_or_path)!r}: no such file and no bundled profile "
                          f"of that name (bundled: {', '.join(bundled_profiles())})")
    if str(path.resolve()) in seen:
        raise ConfigError(f"profile {path}: extends itself")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    data.setdefault("name", path.stem)
    base = data.pop("extends", None)
    if base is not None:
        data = _merge(_read(base, (*seen, str(path.resolve()))), data)
    return data


def _validate(data: dict[str, Any], name: str) -> Profile:
    try:
        return Profile.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"profile {name}: " + _format(err)) from None


def load_profile(name_or_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Profile:
    """A bundled profile by name, or a YAML file, with ``dotted.key=value`` overrides; an override
    ``trainer.KEY=VALUE`` is one of the trainer config's (appended to ``trainer.overrides``)."""
    passed = [o.removeprefix(TRAINER_PREFIX) for o in overrides if _is_trainer_override(o)]
    own = [o for o in overrides if not _is_trainer_override(o)]
    data = _merge(_read(name_or_path), parse_overrides(own))
    trainer_overrides = passed
    if trainer_overrides:
        section = dict(data.get("trainer") or {})
        section["overrides"] = [*section.get("overrides", []), *trainer_overrides]
        data["trainer"] = section
    return _validate(data, str(data.get("name", name_or_path)))


TRAINER_PREFIX = "trainer."


def _is_trainer_override(item: str) -> bool:
    """``trainer.KEY=VALUE`` is the trainer config's, except the section's own two fields."""
    return item.startswith(TRAINER_PREFIX) and item.split("=", 1)[0] not in ("trainer.config", "trainer.model", "trainer.overrides")
