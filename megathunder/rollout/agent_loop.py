"""The multi-turn agent loop: many concurrent episodes, each a growing list of token ids.

One episode: prompt ids from the chat template; then per turn, generate until ``<|im_end|>``,
emit ``turn_finished`` at once (the tool call has not started: per-turn distillation can score
the turn while the tool runs), parse the turn's tool calls, run them in the episode's sandbox,
append their outputs as masked ids, continue. No tool call ends the episode (the model answered).
Then ``trajectory_finished``; the task's verifier runs in the verifier pool, then ``reward``.

Per-target layout (as in :class:`megathunder.trajectory.Trajectory`): target ``t`` is token
``t + 1``. Generated tokens are trained (``loss_mask`` True, engine logprob kept); prompt, tool
outputs and template glue are masked (logprob 0.0, never used).

Limits: ``agent.max_turns``; ``agent.max_total_tokens`` over the whole episode (a turn gets at most
the room left; a turn cut by a length limit ends the episode as truncated, a tool output that
would not fit ends it before the output); ``agent.episode_wall_time_s``, or the instance's own
``agent_timeout_s`` (a benchmark task's harness limit) (generation and tools are
cancelled at the deadline, killing the tool's processes; the verifier still scores the state).

The last turn's tools run (the verifier scores the state they leave) but their output is not
appended: no turn would read it, and no request of the engine would compute those positions. The
trajectory then ends with the model's own last tokens, every input position one the engine
computed -- which routing replay needs (``megathunder.rollout.engines.routing_capture``: the
engine records the routing of the positions it computes; an output appended after the last turn
had none, and the learner refused the trajectory) -- and the learner forwards no positions that
reach no loss (attention is causal: nothing after the last trained token affects it).

Faults: a failed episode (non-finite or mismatched engine logprobs, a sandbox that cannot be set
up, a verifier that raises, times out or returns a non-finite reward) gets ``Episode.failure`` and
the ``verifier.on_failure`` outcome; a sandbox that is lost mid-episode (a tool call raises
``SandboxError``: the container gone, a sandbox server lost where the sandbox cannot be re-run)
ends the episode there with ``verifier.on_infra_failure``, never an observation the model trains
on; RELIABILITY.md lists every fault and its policy.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from megathunder.config import AgentLoopConfig, Config, ConfigError, SandboxConfig
from megathunder.rollout.chat import ChatCodec, ToolCall, ToolCallError
from megathunder.rollout.episode import (
    CURRENT_EPISODE,
    SANDBOX_FAILURE,
    Episode,
    EventSink,
    RolloutEvent,
    StopReason,
    ToolRun,
    Turn,
)
from megathunder.rollout.priority import Priorities, Scheduling
from megathunder.rollout.sandbox import Sandbox, SandboxError, build_sandbox
from megathunder.rollout.tasks.task import Task, TaskInstance
from megathunder.rollout.tools import Tool, ToolArgumentError
from megathunder.rollout.types import Completion, RolloutEngine, RoutingSource, SamplingParams
from megathunder.rollout.verifiers import Verdict, VerifierPool

log = logging.getLogger(__name__)

Verify = Callable[[], Awaitable[float | Verdict]]


@dataclass(frozen=True)
class Refill:
    """How a batch replaces the groups it drops (DAPO's dynamic sampling; ``batch.max_refill_groups``)."""

    max_groups: int  # replacements at most
    instance: Callable[[int], TaskInstance | None]  # the j-th replacement's prompt (None: no more)
    dropped: Callable[[Sequence[Episode]], bool]  # a finished group leaves the batch
    announce: Callable[[int, list[int]], None]  # (group id, trajectory ids), before its episodes start


class Pause:
    """Closes a loop's episodes' next generate calls: ``async with loop.pause: ...`` (the trainer's
    evaluation, on the same engine). An episode that reaches a turn while it is closed waits there,
    and its wall-time deadline moves by the wait: a paused episode is neither slowed by nor timed
    out for work not its own. What it is already doing (a turn generating, a tool call, its
    verifier) runs on."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._depth = 0

    async def __aenter__(self) -> Pause:
        self._depth += 1
        self._open.clear()
        return self

    async def __aexit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._open.set()

    @property
    def closed(self) -> bool:
        return not self._open.is_set()

    async def wait(self) -> float:
        """Until open; the seconds waited."""
        if self._open.is_set():
            return 0.0
        t0 = time.monotonic()
        await self._open.wait()
        return time.monotonic() - t0


class AgentLoop:
    def __init__(
        self,
        engine: RolloutEngine,
        codec: ChatCodec,
        task: Task,
        agent_cfg: AgentLoopConfig,
        sandbox_cfg: SandboxConfig,
        verifiers: VerifierPool,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        emit: EventSink | None = None,
        scheduling: Scheduling = "fifo",
        routing: RoutingSource | None = None,
    ) -> None:
        self.engine, self.codec, self.task = engine, codec, task
        self.routing = routing  # routing replay: where each finished episode's routed experts are read
        self.priorities = Priorities(scheduling)
        self.cfg, self.sandbox_cfg, self.verifiers = agent_cfg, sandbox_cfg, verifiers
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.emit = emit or (lambda event: None)
        self.pause = Pause()
        self.tools: dict[str, Tool] = {t.name: t for t in task.tools}
        self._slots = asyncio.Semaphore(agent_cfg.max_concurrent_episodes)

    def _event(self, kind, ep: Episode, **kw) -> None:
        self.emit(
            RolloutEvent(
                kind=kind, traj_id=ep.traj_id, group_id=ep.group_id, time=time.monotonic(), **kw
            )
        )

    async def run_batch(
        self, instances: Sequence[TaskInstance], samples_per_prompt: int, *, seed: int | None = None,
        refill: Refill | None = None,
    ) -> list[Episode]:
        """``samples_per_prompt`` episodes per instance (a group each), all run concurrently.

        Trajectory ``g * samples_per_prompt + k`` is sample ``k`` of group ``g``. With ``seed``
        (vary it per batch), sampling is reproducible; without, the engine draws its own. With
        ``refill``, each group that finishes dropped is replaced by group ``len(instances) + j`` (the
        j-th replacement, on ``refill.instance(j)``), announced before its episodes start, up to
        ``refill.max_groups``. The groups run are then those of the shortest prefix of the prompt
        sequence with ``len(instances)`` kept groups (or the budget's end), whatever order they
        finish in: each replacement is caused by one drop among the groups before it. Episodes are
        returned in trajectory order.
        """
        s = samples_per_prompt
        groups: dict[asyncio.Future, int] = {}  # each group's gather -> its group id
        jobs: list[asyncio.Future] = []  # every episode started
        episodes: list[Episode] = []

        def launch(g: int, inst: TaskInstance) -> None:
            mine = [asyncio.ensure_future(self.run_episode(inst, traj_id=g * s + k, group_id=g,
                                                           seed=None if seed is None else seed * 1_000_003 + g * s + k))
                    for k in range(s)]
            jobs.extend(mine)
            groups[asyncio.gather(*mine)] = g

        for g, inst in enumerate(instances):
            launch(g, inst)
        refilled = 0
        try:
            while groups:
                done, _ = await asyncio.wait(list(groups), return_when=asyncio.FIRST_COMPLETED)
                for fut in sorted(done, key=groups.__getitem__):
                    del groups[fut]
                    members = list(fut.result())  # an episode that raised stops the batch (below)
                    episodes.extend(members)
                    if refill is not None and refilled < refill.max_groups and refill.dropped(members):
                        g = len(instances) + refilled
                        new = refill.instance(refilled)
                        if new is None:  # the task has no more distinct prompts
                            refill = None
                            continue
                        refilled += 1
                        refill.announce(g, [g * s + k for k in range(s)])
                        launch(g, new)
        except BaseException:  # one episode raised (or we were cancelled): stop the others too
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, *groups, return_exceptions=True)  # their sandboxes are closed
            raise
        episodes.sort(key=lambda e: e.traj_id)
        if self.task.needs_sandbox and all((e.failure or "").startswith(SANDBOX_FAILURE) for e in episodes):
            raise SandboxError(f"no sandbox of the batch could be set up; the first: {episodes[0].failure}")
        return episodes

    async def run_episode(
        self, inst: TaskInstance, *, traj_id: int, group_id: int, seed: int | None = None
    ) -> Episode:
        async with self._slots:
            prompt = self.codec.prompt_ids(self.task.messages(inst), self.task.tool_schemas())
            if len(prompt) >= self.cfg.max_total_tokens:  # no turn could be sampled: not an episode
                raise ConfigError(
                    f"agent.max_total_tokens: {self.cfg.max_total_tokens} leaves no room to answer the prompt of "
                    f"{inst.instance_id} ({len(prompt)} tokens: the task's messages and tool schemas); raise it, "
                    "and rollout.engine.max_model_len with it")
            ep = Episode.from_prompt(traj_id, group_id, inst.instance_id, prompt, time.monotonic())
            CURRENT_EPISODE.set(ep)  # this task's: its tool calls and verifier run under it
            self.priorities.started(traj_id, group_id)
            sandbox = None
            try:
                try:
                    if self.task.needs_sandbox:  # the task's own environment, or a refusal naming it
                        sandbox = await build_sandbox(self.sandbox_cfg, inst.image, environment=inst.environment)
                    await self.task.setup(inst, sandbox)
                except SandboxError as err:  # this episode fails (recorded); the batch goes on
                    ep.failure, ep.stop_reason = f"{SANDBOX_FAILURE}{err}", "failed"
                    log.warning("episode %d: %s", traj_id, ep.failure)
                    return await self._finish(ep, inst, None)
                now = time.monotonic()
                ep.setup_s, ep.started_at = now - ep.started_at, now  # the wall-time budget starts with the first turn
                try:
                    return await self._episode(ep, inst, seed, sandbox)
                except SandboxError as err:  # lost mid-episode and not re-run: an infrastructure failure
                    ep.failure, ep.stop_reason = f"{SANDBOX_FAILURE}lost mid-episode: {err}", "failed"
                    log.warning("episode %d: %s", traj_id, ep.failure)
                    return await self._finish(ep, inst, None)
            finally:
                self.priorities.finished(traj_id, group_id)  # also when cancelled
                if sandbox is not None:
                    await sandbox.close()

    async def _episode(self, ep: Episode, inst, seed, sandbox: Sandbox | None) -> Episode:
        deadline = ep.started_at + (inst.agent_timeout_s or self.cfg.episode_wall_time_s)  # the task's own first
        try:
            ep.stop_reason = await self._turns(ep, sandbox, deadline, seed)
        except TimeoutError:
            ep.stop_reason = "wall_time"
        return await self._finish(ep, inst, sandbox)

    async def _finish(self, ep: Episode, inst, sandbox: Sandbox | None) -> Episode:
        """Emit the trajectory's end, score it (unless it failed), emit its reward."""
        traj_id = ep.traj_id
        if self.routing is not None and ep.failure is None:  # before any weight push can clear the record
            ep.routed_experts = await self.routing.routed_experts(ep.token_ids, session_id=traj_id)
        ep.finished_at = time.monotonic()
        self.priorities.finished(traj_id, ep.group_id)  # no longer generating: its group is closer to done
        self._event("trajectory_finished", ep, payload={"episode": ep, "failure": ep.failure})

        if ep.failure is None and ep.truncated and self.verifiers.cfg.truncated_reward is not None:
            ep.reward = self.verifiers.truncated()
        elif ep.failure is None:
            verify: Verify = lambda: self.task.verify(inst, ep, sandbox)  # noqa: E731
            ep.reward = await self.verifiers.score(
                verify, traj_id=traj_id, timeout_s=self.task.verifier_timeout_s(inst, self.verifiers.cfg.timeout_s))
            if ep.reward.status != "ok":
                ep.failure = f"verifier_{ep.reward.status}: {ep.reward.detail}"
        else:  # nothing to score: the configured failure outcome, as for a failed verifier
            ep.reward = self.verifiers.failed(traj_id, ep.failure)
        ep.rewarded_at = time.monotonic()
        self._event("reward", ep, payload=ep.reward.as_payload())
        return ep

    async def _turns(self, ep: Episode, sandbox, deadline: float, seed) -> StopReason:
        for index in range(self.cfg.max_turns):
            room = self.cfg.max_total_tokens - len(ep.token_ids)
            if room <= 0:
                ep.truncated = True
                return "max_tokens"
            params = SamplingParams(
                max_new_tokens=min(self.cfg.max_new_tokens_per_turn, room),
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                stop_token_ids=self.codec.stop_token_ids,
                seed=None if seed is None else (seed * 1009 + index) % 2**63,
                priority=self.priorities.of(ep.traj_id, ep.group_id),
            )
            deadline += await self.pause.wait()
            t0 = time.monotonic()
            out: Completion = await asyncio.wait_for(
                self.engine.generate(ep.token_ids, params, session_id=ep.traj_id), _remaining(deadline)
            )
            bad = _bad_logprobs(out)
            if bad is not None:  # nothing of this turn is kept or emitted
                ep.failure = f"{bad} (turn {index})"
                return "failed"
            start = len(ep.token_ids)
            turn = Turn(
                index=index, start=start, end=start + len(out.token_ids),
                finish_reason=out.finish_reason, policy_version=out.policy_version,
                started_at=t0, generated_at=time.monotonic(),
            )  # fmt: skip
            ep.append(out.token_ids, out.logprobs)
            ep.turns.append(turn)
            ep.final_text = self.codec.turn_text(out.token_ids)
            if out.finish_reason == "stop" and out.token_ids[-1:] not in [[t] for t in self.codec.stop_token_ids]:
                # The engine stopped on the end-of-turn token but did not return it: close the turn (masked).
                ep.append([self.codec.end_of_turn_id], None)
            self._event(
                "turn_finished", ep, turn_index=index,
                payload={"start": turn.start, "end": turn.end, "token_ids": list(ep.token_ids[: turn.end]),
                         "logprobs": list(out.logprobs), "policy_version": out.policy_version},
            )  # fmt: skip
            if out.finish_reason == "abort":
                return "engine_abort"
            if out.finish_reason == "length":
                ep.truncated = True
                return "max_tokens"

            calls = self.codec.parse_tool_calls(ep.final_text)
            if not calls:
                return "answered"
            limit = self.cfg.max_tool_calls_per_turn
            observations = [await self._run_tool(c, sandbox, deadline, turn) for c in calls[:limit]]
            if len(calls) > limit:
                observations.append(
                    f"[error: only {limit} tool calls per turn are run; {len(calls) - limit} ignored]"
                )
            turn.tools_done_at = time.monotonic()
            if index + 1 == self.cfg.max_turns:  # no turn reads a response: not appended (module docstring)
                break
            response = self.codec.tool_response_ids(observations)
            if len(ep.token_ids) + len(response) >= self.cfg.max_total_tokens:
                ep.truncated = True
                return "max_tokens"
            ep.append(response, None)
        return "max_turns"

    async def _run_tool(
        self, call: ToolCall | ToolCallError, sandbox, deadline: float, turn: Turn
    ) -> str:
        t0 = time.monotonic()
        name, args = getattr(call, "name", "?"), getattr(call, "arguments", None)
        if isinstance(call, ToolCallError):
            obs, ok = f"[error: {call.message}]", False
        elif call.name not in self.tools:
            available = ", ".join(self.tools) or "none"
            obs, ok = f"[error: unknown tool {call.name!r}; available: {available}]", False
        else:
            tool = self.tools[call.name]
            try:
                obs = await asyncio.wait_for(
                    tool.run(sandbox, tool.check_arguments(call.arguments)), _remaining(deadline)
                )
                ok = not obs.rstrip().rpartition("\n")[2].startswith("[error:")  # last line
            except ToolArgumentError as err:
                obs, ok = f"[error: {err}]", False
            except (TimeoutError, SandboxError):
                raise  # the episode's wall time is over; its sandbox is gone (never an observation to train on)
            except Exception as err:  # a crashing tool is an observation, not a dead episode
                log.warning("tool %s crashed: %r", call.name, err)
                obs, ok = f"[error: tool {call.name!r} crashed: {type(err).__name__}: {err}]", False
        turn.tool_runs.append(ToolRun(name, args, obs, time.monotonic() - t0, ok))
        return obs


def _bad_logprobs(out: Completion) -> str | None:
    """Why a completion's logprobs cannot be trained on, or None."""
    if len(out.logprobs) != len(out.token_ids):
        return f"engine_protocol: {len(out.logprobs)} logprobs for {len(out.token_ids)} tokens"
    for k, lp in enumerate(out.logprobs):
        if not math.isfinite(lp):
            return f"nonfinite_logprob: {lp} at token {k}"
    return None


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def build_agent_loop(cfg: Config, engine: RolloutEngine, codec: ChatCodec, task: Task, *,
                     temperature: float | None = None, emit: EventSink | None = None,
                     routing: RoutingSource | None = None) -> AgentLoop:
    """The agent loop of a run's config: ``task`` (built once per run), the ``agent`` limits, the
    ``sandbox`` and ``verifier`` sections, sampling at ``temperature`` (default
    ``rollout.temperature``; ``rollout.top_p`` / ``top_k`` apply unless a temperature is given:
    evaluation samples its own way); events go to ``emit``; each finished episode's routed experts
    are read from ``routing`` (routing replay: the engine, when it records them)."""
    r = cfg.rollout
    scheduling = r.engine.scheduling
    if temperature is not None:
        return AgentLoop(engine, codec, task, cfg.agent, cfg.sandbox, VerifierPool(cfg.verifier),
                         temperature=temperature, emit=emit, scheduling=scheduling)
    return AgentLoop(engine, codec, task, cfg.agent, cfg.sandbox, VerifierPool(cfg.verifier),
                     temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, emit=emit, scheduling=scheduling,
                     routing=routing)
