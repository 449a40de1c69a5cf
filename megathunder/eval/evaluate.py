"""Evaluation: held-out instances through the training agent loop, k samples each, pass@1..k.

:func:`evaluate` is a plain async function over a live engine, so the trainer calls it between
steps with its own rollout engine (``await evaluate(cfg, engine, codec, task, instances)``) and
``megathunder eval`` calls it on an engine started from a checkpoint. Episodes are the agent
loop's own (:func:`~megathunder.rollout.agent_loop.build_agent_loop`: same template, tools,
sandboxes, limits and verifier pool); nothing is emitted to a learner.

In the trainer (``eval_instances`` drawn once; ``training_instances`` keeps batches off them)::

    if eval_due(cfg, step):
        result = await evaluate(cfg, engine, codec, task, eval_set)
        row.update(result.metrics())  # eval/pass@1 ... into this step's metrics.jsonl row

Every sample ends in one recorded outcome:

* ``ok``: the verifier scored it; it passes when ``reward >= eval.pass_reward``;
* ``verifier_error`` / ``verifier_timeout``: the verifier crashed or ran out of time. The episode
  is complete, so the sample counts, as a fail, whatever ``verifier.on_failure`` says for
  training; its instance is counted in ``num_failed`` and the message is kept;
* ``episode_error``: the episode itself raised or failed before scoring (an engine failure, such as
  non-finite logprobs: ``Episode.failure``); the sample is *missing*.

pass@j is averaged over all ``num_instances`` instances and refuses (:class:`MissingSamplesError`)
while any sample is missing, so a score is never computed on fewer instances or samples than it
claims.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

from tqdm import tqdm

from megathunder.config import Config
from megathunder.eval.passk import pass_at_k_over_instances
from megathunder.rollout.agent_loop import build_agent_loop
from megathunder.rollout.chat import ChatCodec
from megathunder.rollout.episode import Episode
from megathunder.rollout.tasks.task import Task, TaskInstance
from megathunder.rollout.types import RolloutEngine
from megathunder.rollout.verifiers import VerifierStatus

SampleStatus = Literal["ok", "verifier_error", "verifier_timeout", "episode_error"]


class MissingSamplesError(RuntimeError):
    """A pass@k asked for while some instance has fewer than k samples."""


@dataclass
class SampleOutcome:
    sample: int
    status: SampleStatus
    reward: float | None
    passed: bool
    detail: str = ""
    tests: dict[str, str] | None = None  # the verifier's per-test outcome (SWE-style tasks)
    stop_reason: str | None = None
    policy_versions: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    generation_s: float = 0.0
    tool_s: float = 0.0
    verifier_s: float = 0.0
    wall_s: float = 0.0
    final_text: str = ""


@dataclass
class InstanceOutcome:
    instance_id: str
    samples: list[SampleOutcome]

    @property
    def num_samples(self) -> int:
        """Samples with an outcome (verifier failures included, crashed episodes not)."""
        return sum(s.status != "episode_error" for s in self.samples)

    @property
    def num_correct(self) -> int:
        return sum(s.passed for s in self.samples)

    @property
    def failed(self) -> bool:
        """Some sample's verifier failed or its episode crashed."""
        return any(s.status != "ok" for s in self.samples)


@dataclass
class EvalResult:
    k: int
    instances: list[InstanceOutcome]
    wall_s: float
    policy_version: int  # the engine's, when the evaluation started

    @property
    def num_instances(self) -> int:
        return len(self.instances)

    @property
    def num_failed(self) -> int:
        """Instances with at least one verifier failure or crashed episode."""
        return sum(i.failed for i in self.instances)

    def num_samples_with(self, *statuses: SampleStatus) -> int:
        return sum(s.status in statuses for i in self.instances for s in i.samples)

    @property
    def policy_versions(self) -> list[int]:
        """Weight versions that generated the samples (one unless weights changed mid-eval)."""
        return sorted({v for i in self.instances for s in i.samples for v in s.policy_versions})

    def pass_at(self, k: int) -> tuple[float, float]:
        """(pass@k, standard error) over every instance; raises while any sample is missing."""
        if not 1 <= k <= self.k:
            raise ValueError(f"pass@{k}: this evaluation drew {self.k} samples per instance")
        short = [i for i in self.instances if i.num_samples < self.k]
        if short:
            names = ", ".join(f"{i.instance_id} ({i.num_samples})" for i in short[:5])
            more = f" and {len(short) - 5} more" if len(short) > 5 else ""
            raise MissingSamplesError(
                f"pass@{k}: {len(short)} of the {self.num_instances} instances have fewer than "
                f"the {self.k} samples drawn (episodes that raised): {names}{more}"
            )
        return pass_at_k_over_instances([(i.num_samples, i.num_correct) for i in self.instances], k)

    def pass_at_all(self) -> dict[int, tuple[float, float]]:
        return {j: self.pass_at(j) for j in range(1, self.k + 1)}

    def cost(self) -> dict[str, float]:
        samples = [s for i in self.instances for s in i.samples]
        total = lambda name: sum(getattr(s, name) for s in samples)  # noqa: E731
        return {
            "num_episodes": len(samples),
            "num_prompt_tokens": total("num_prompt_tokens"),
            "num_generated_tokens": total("num_generated_tokens"),
            "num_turns": total("num_turns"),
            "num_tool_calls": total("num_tool_calls"),
            "num_tool_errors": total("num_tool_errors"),
            "generation_s": total("generation_s"),
            "tool_s": total("tool_s"),
            "verifier_s": total("verifier_s"),
            "wall_s": self.wall_s,
        }

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """Flat metrics for a metrics.jsonl row or wandb: ``eval/pass@1``, ``eval/pass@1_stderr``,
        ..., counts and cost. Raises :class:`MissingSamplesError` when samples are missing."""
        out: dict[str, float] = {}
        for j, (mean, stderr) in self.pass_at_all().items():
            out[f"{prefix}pass@{j}"] = mean
            out[f"{prefix}pass@{j}_stderr"] = stderr
        out[f"{prefix}mean_reward"] = _mean_reward(self)
        out[f"{prefix}num_instances"] = self.num_instances
        out[f"{prefix}num_failed"] = self.num_failed
        out[f"{prefix}num_verifier_failures"] = self.num_samples_with(
            "verifier_error", "verifier_timeout"
        )
        out.update({f"{prefix}{name}": v for name, v in self.cost().items()})
        return out

    def to_json(self) -> dict:
        """Everything, JSON-serialisable (NaN as null); scores absent, with the reason, when
        samples are missing."""
        try:
            scores = {
                f"pass@{j}": {"mean": m, "stderr": _finite(se)}
                for j, (m, se) in self.pass_at_all().items()
            }
            error = None
        except MissingSamplesError as err:
            scores, error = None, str(err)
        return {
            "k": self.k,
            "num_instances": self.num_instances,
            "num_failed": self.num_failed,
            "num_verifier_failures": self.num_samples_with("verifier_error", "verifier_timeout"),
            "num_missing_samples": self.num_samples_with("episode_error"),
            "scores": scores,
            "error": error,
            "mean_reward": _finite(_mean_reward(self)),
            "policy_version": self.policy_version,
            "policy_versions": self.policy_versions,
            "cost": self.cost(),
            "instances": [
                {
                    "instance_id": i.instance_id,
                    "num_samples": i.num_samples,
                    "num_correct": i.num_correct,
                    "failed": i.failed,
                    "samples": [asdict(s) for s in i.samples],
                }
                for i in self.instances
            ],
        }


def _mean_reward(result: EvalResult) -> float:
    rewards = [s.reward for i in result.instances for s in i.samples if s.reward is not None]
    return math.fsum(rewards) / len(rewards) if rewards else math.nan


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


_STATUS: dict[VerifierStatus, SampleStatus] = {
    "ok": "ok", "error": "verifier_error", "timeout": "verifier_timeout",
    "skipped": "episode_error",  # the episode failed before scoring (non-finite logprobs)
}  # fmt: skip


def _sample_outcome(sample: int, ep: Episode, pass_reward: float) -> SampleOutcome:
    out = ep.reward
    assert out is not None  # the agent loop scores every episode it returns (status skipped if failed)
    status = _STATUS[out.status]
    runs = [r for t in ep.turns for r in t.tool_runs]
    return SampleOutcome(
        sample=sample,
        status=status,
        reward=None if status == "episode_error" else out.reward,
        passed=status == "ok" and out.reward is not None and out.reward >= pass_reward,
        detail=out.detail,
        tests=None if out.tests is None else dict(out.tests),
        stop_reason=ep.stop_reason,
        policy_versions=sorted(ep.policy_versions),
        num_prompt_tokens=ep.prompt_len,
        num_generated_tokens=sum(ep.loss_mask),
        num_turns=len(ep.turns),
        num_tool_calls=len(runs),
        num_tool_errors=sum(not r.ok for r in runs),
        generation_s=ep.generation_s,
        tool_s=ep.tool_s,
        verifier_s=out.duration_s,
        wall_s=ep.finished_at - ep.started_at + out.duration_s,
        final_text=ep.final_text[-500:],
    )


def _all_done(row: Sequence[SampleOutcome | None]) -> list[SampleOutcome]:
    done = [s for s in row if s is not None]
    assert len(done) == len(row), "internal: an episode has no outcome"
    return done


async def evaluate(
    cfg: Config,
    engine: RolloutEngine,
    codec: ChatCodec,
    task: Task,
    instances: Sequence[TaskInstance],
    k: int | None = None,
    *,
    temperature: float | None = None,
    seed: int | None = None,
    pass_reward: float | None = None,
    progress: bool = False,
) -> EvalResult:
    """Run ``k`` episodes of each instance through ``cfg``'s agent loop on ``engine``.

    ``k``, ``temperature``, ``seed`` and ``pass_reward`` default to ``cfg.eval``'s. Sampling is
    reproducible from ``seed``. ``progress`` shows a tqdm bar over episodes.
    """
    ev = cfg.eval
    k = ev.k if k is None else k
    temperature = ev.temperature if temperature is None else temperature
    seed = ev.seed if seed is None else seed
    pass_reward = ev.pass_reward if pass_reward is None else pass_reward
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if temperature < 0 or (temperature == 0 and k > 1):
        raise ValueError(f"temperature {temperature} with k={k}: greedy (0) needs k=1, else > 0")
    if not instances:
        raise ValueError("evaluate: no instances")
    ids = [i.instance_id for i in instances]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"evaluate: duplicate instance ids {dup[:5]} would be counted twice")

    loop = build_agent_loop(cfg, engine, codec, task, temperature=temperature)
    policy_version = engine.policy_version

    async def one(g: int, s: int, inst: TaskInstance) -> tuple[int, int, SampleOutcome]:
        traj_id = g * k + s
        try:
            ep = await loop.run_episode(
                inst, traj_id=traj_id, group_id=g, seed=seed * 1_000_003 + traj_id
            )
        except Exception as err:  # recorded as a missing sample; pass@k then refuses
            detail = f"episode raised {type(err).__name__}: {err}"
            return g, s, SampleOutcome(s, "episode_error", None, False, detail=detail)
        return g, s, _sample_outcome(s, ep, pass_reward)

    samples: list[list[SampleOutcome | None]] = [[None] * k for _ in instances]
    start = time.monotonic()
    # tasks created in order, so episodes start (and queue for slots) instance by instance
    jobs = [
        asyncio.ensure_future(one(g, s, inst)) for g, inst in enumerate(instances) for s in range(k)
    ]
    with tqdm(total=len(jobs), desc="eval", unit="episode", disable=not progress) as bar:
        try:
            for done in asyncio.as_completed(jobs):
                g, s, outcome = await done
                samples[g][s] = outcome
                bar.update(1)
        finally:  # cancelled (the caller gave up): no episode keeps running
            for job in jobs:
                job.cancel()
    return EvalResult(
        k=k,
        instances=[
            InstanceOutcome(inst.instance_id, _all_done(row))
            for inst, row in zip(instances, samples, strict=True)
        ],
        wall_s=time.monotonic() - start,
        policy_version=policy_version,
    )
