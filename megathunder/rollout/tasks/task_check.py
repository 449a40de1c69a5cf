"""``megathunder tasks check``: does each task's reward tell its solution from no work at all?

A reward that lies poisons every group it is in: a task whose do-nothing agent passes (its test
compares two things the agent never touches) rewards nothing, and one whose own solution fails
(a broken image, a test that cannot pass) punishes everything. For every instance this runs, in
the configured sandbox, two episodes through the real agent loop, verifier pool and failure
policy:

- the *oracle*: the task's own solution (``Task.scripted_turns``: a Harbor ``solve.sh``, a
  Terminal-Bench 1 ``solution.sh``, a SWE gold patch) played by the scripted policy;
- the *null agent*: one turn that ends the episode without touching anything.

An instance is ``ok`` when the oracle's reward reaches ``pass_reward`` and the null agent's does
not; otherwise it is reported with every problem found: ``broken_oracle``, ``false_positive``,
``no_oracle`` (the task ships no solution), ``env_error`` (its environment could not be built,
refused by the backend, or failed under either episode -- an infrastructure failure). Instances run
``concurrency`` at a time, the two episodes of each together; their images are built first, once
each. The oracle's tool calls get the agent's whole time limit (the task's own, else
``agent.episode_wall_time_s``): a solution script is one long command.

Timings per instance (``megathunder bench tasks`` tabulates them): the image build, each
episode's seconds from sandbox start to reward, and each test run's own seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megathunder.config import (
    AgentLoopConfig,
    Config,
    ConfigError,
    ContainerSandboxConfig,
    DatasetTaskConfig,
    LocalSandboxConfig,
    RemoteSandboxConfig,
    SandboxConfig,
    VerifierConfig,
    sandbox_runtime,
)
from megathunder.rollout.episode import Episode
from megathunder.rollout.sandbox import SandboxError, close_sandbox_pools, prepare_image
from megathunder.rollout.sandbox.local import refusal
from megathunder.rollout.tasks.task import DatasetTask, TaskInstance

log = logging.getLogger(__name__)

NULL_TURN = "I will not change anything."


@dataclass
class EpisodeCheck:
    reward: float | None  # None: no reward (the episode failed and its group was dropped)
    status: str  # the verifier's: ok, error, timeout, skipped
    infra: bool
    seconds: float
    test_s: float | None  # the test run's own seconds, when the verifier reports it
    detail: str = ""

    @classmethod
    def of(cls, ep: Episode, seconds: float) -> EpisodeCheck:
        out = ep.reward
        assert out is not None  # the agent loop scores every episode it returns
        try:
            verdict = json.loads(out.detail) if out.detail.startswith("{") else {}
        except json.JSONDecodeError:
            verdict = {}
        test_s = verdict.get("test_s")
        why = ep.failure or verdict.get("log_tail") or verdict.get("resolution") or out.detail
        return cls(out.reward, out.status, out.infra, seconds, test_s, str(why)[-300:])


@dataclass
class TaskCheck:
    instance_id: str
    problems: list[str] = field(default_factory=list)
    build_s: float = 0.0
    oracle: EpisodeCheck | None = None
    null: EpisodeCheck | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems


def _judge(check: TaskCheck, pass_reward: float) -> None:
    for name, ep in (("oracle", check.oracle), ("null", check.null)):
        if ep is not None and ep.infra:
            check.problems.append("env_error")
            check.detail = check.detail or f"{name}: {ep.detail}"
            return
    if check.oracle is not None and (check.oracle.status != "ok" or (check.oracle.reward or 0.0) < pass_reward):
        check.problems.append("broken_oracle")
        check.detail = check.detail or f"oracle: reward {check.oracle.reward} ({check.oracle.status}): {check.oracle.detail}"
    if check.null is not None and check.null.status == "ok" and (check.null.reward or 0.0) >= pass_reward:
        check.problems.append("false_positive")
        check.detail = check.detail or f"null agent: reward {check.null.reward}"


def _tool_limits(cfg: SandboxConfig, wall_s: float) -> SandboxConfig:
    """The sandbox with the agent's whole time as each command's limit (a solution script); sandbox
    servers take it per sandbox (time limits are not capped by a server)."""
    rt = sandbox_runtime(cfg)
    rt = rt.model_copy(update={"wall_time_s": max(rt.wall_time_s, wall_s), "cpu_time_s": max(rt.cpu_time_s, wall_s)})
    return cfg.model_copy(update={"runtime": rt}) if isinstance(cfg, RemoteSandboxConfig) else rt


async def _episode(task: DatasetTask, inst: TaskInstance, turns: Sequence[str], sandbox: SandboxConfig,
                   agent: AgentLoopConfig, verifier: VerifierConfig, traj_id: int) -> EpisodeCheck:
    from megathunder.models.local_tokenizer import train_local_chatml_tokenizer
    from megathunder.rollout.agent_loop import AgentLoop
    from megathunder.rollout.chat import ChatMLCodec
    from megathunder.rollout.scripted import ScriptedPolicy
    from megathunder.rollout.verifiers import VerifierPool

    codec = ChatMLCodec(train_local_chatml_tokenizer())
    loop = AgentLoop(ScriptedPolicy(codec, {inst.prompt: list(turns)}), codec, task, agent, sandbox,
                     VerifierPool(verifier))
    start = time.monotonic()
    ep = await loop.run_episode(inst, traj_id=traj_id, group_id=traj_id)
    return EpisodeCheck.of(ep, time.monotonic() - start)


async def check_instances(task: DatasetTask, instances: Sequence[TaskInstance], sandbox: SandboxConfig,
                          verifier: VerifierConfig, agent: AgentLoopConfig | None = None, *,
                          concurrency: int = 4, pass_reward: float = 1.0,
                          on_result: Callable[[TaskCheck], None] | None = None) -> list[TaskCheck]:
    """One :class:`TaskCheck` per instance, in order (see the module docstring)."""
    agent = agent or AgentLoopConfig()
    slots = asyncio.Semaphore(concurrency)

    async def one(k: int, inst: TaskInstance) -> TaskCheck:
        check = TaskCheck(inst.instance_id)
        async with slots:
            if isinstance(sandbox, ContainerSandboxConfig):
                try:
                    check.build_s = await prepare_image(sandbox, inst.image or sandbox.image or "", inst.environment)
                except SandboxError as err:
                    check.problems, check.detail = ["env_error"], f"image: {err}"
            elif (isinstance(runtime := sandbox_runtime(sandbox), LocalSandboxConfig)
                  and (why := refusal(runtime, inst.environment)) is not None):
                check.problems, check.detail = ["env_error"], f"the local sandbox cannot provide it: {why}"
            if check.problems:
                return _done(check, on_result)
            try:
                oracle_turns: Sequence[str] | None = task.scripted_turns(inst)
            except NotImplementedError as err:
                oracle_turns, check.problems, check.detail = None, ["no_oracle"], str(err)
            wall = inst.agent_timeout_s or agent.episode_wall_time_s
            limits = agent.model_copy(update={
                "max_turns": len(oracle_turns or ()) + 2, "max_tool_calls_per_turn": 1,
                "max_new_tokens_per_turn": 1 << 22, "max_total_tokens": 1 << 23})
            cfg = _tool_limits(sandbox, wall)
            runs = [_episode(task, inst, [NULL_TURN], cfg, limits, verifier, 2 * k + 1)]
            if oracle_turns is not None:
                runs.insert(0, _episode(task, inst, oracle_turns, cfg, limits, verifier, 2 * k))
            done = await asyncio.gather(*runs)
            check.oracle, check.null = (done[0], done[1]) if oracle_turns is not None else (None, done[0])
        _judge(check, pass_reward)
        return _done(check, on_result)

    try:
        return list(await asyncio.gather(*(one(k, inst) for k, inst in enumerate(instances))))
    finally:
        await close_sandbox_pools()  # run in a loop of its own (asyncio.run): its connections to sandbox servers


def _done(check: TaskCheck, on_result: Callable[[TaskCheck], None] | None) -> TaskCheck:
    if on_result is not None:
        on_result(check)
    return check


def report_rows(checks: Sequence[TaskCheck]) -> list[dict[str, Any]]:
    """JSON-ready rows: one per instance."""
    return [{"task": c.instance_id, "ok": c.ok, "problems": c.problems, "build_s": round(c.build_s, 2),
             "oracle": None if c.oracle is None else asdict(c.oracle),
             "null": None if c.null is None else asdict(c.null), "detail": c.detail} for c in checks]


def format_table(checks: Sequence[TaskCheck]) -> str:
    """A table: each instance, its verdict, both rewards and the seconds spent."""
    def reward(ep: EpisodeCheck | None) -> str:
        if ep is None:
            return "-"
        return f"{ep.reward:g}" if ep.reward is not None and not ep.infra else ("env" if ep.infra else ep.status)

    def secs(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    head = f"{'task':<28} {'verdict':<28} {'oracle':>6} {'null':>5} {'build s':>8} {'oracle s':>8} {'null s':>7} {'test s':>11}"
    lines = [head, "-" * len(head)]
    for c in checks:
        tests = "/".join(secs(ep.test_s if ep else None) for ep in (c.oracle, c.null))
        lines.append(f"{c.instance_id[:28]:<28} {','.join(c.problems) or 'ok':<28} {reward(c.oracle):>6} "
                     f"{reward(c.null):>5} {c.build_s:>8.1f} {secs(c.oracle.seconds if c.oracle else None):>8} "
                     f"{secs(c.null.seconds if c.null else None):>7} {tests:>11}")
    bad = [c for c in checks if not c.ok]
    lines.append(f"{len(checks) - len(bad)} of {len(checks)} tasks ok" +
                 "".join(f"\n  {c.instance_id}: {','.join(c.problems)}: {c.detail[:300]}" for c in bad))
    return "\n".join(lines)


def check_before_training(cfg: Config, task: Any, out: Path, *, rank: int, barrier: Callable[[], None]) -> None:
    """``task.check_before_training``: rank 0 checks every instance of the training set and writes
    ``out/tasks_check.json``; then every rank drops the bad ones (``drop``) or the run stops naming
    them (``refuse``). Nothing happens with ``off`` or for a task that is not a dataset's."""
    tcfg = cfg.task
    if not isinstance(tcfg, DatasetTaskConfig) or tcfg.check_before_training == "off":
        return
    assert isinstance(task, DatasetTask)
    path = out / "tasks_check.json"
    if rank == 0:
        start = time.monotonic()
        checks = asyncio.run(check_instances(task, task.all_instances(), cfg.sandbox, cfg.verifier, cfg.agent,
                                             concurrency=tcfg.check_concurrency))
        print(format_table(checks), flush=True)
        path.write_text(json.dumps({"seconds": round(time.monotonic() - start, 1), "tasks": report_rows(checks)},
                                   indent=1) + "\n")
    barrier()
    bad = {row["task"]: row["problems"] for row in json.loads(path.read_text())["tasks"] if not row["ok"]}
    if not bad:
        return
    named = ", ".join(f"{k} ({','.join(v)})" for k, v in sorted(bad.items()))
    if tcfg.check_before_training == "refuse":
        raise ConfigError(f"task.check_before_training=refuse: {len(bad)} task(s) whose reward would lie or whose "
                          f"environment fails: {named} (report: {path})")
    try:
        task.drop(bad)
    except ValueError as err:
        raise ConfigError(f"task.check_before_training=drop: {err}: {named}") from None
    log.warning("task.check_before_training=drop: dropped %d task(s): %s", len(bad), named)
