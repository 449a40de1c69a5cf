"""The in-process engine started again in place when its engine core dies (``InProcessEngine``'s
restart): with a stand-in for vLLM's ``AsyncLLM`` whose engine core can be killed, checked for the
ordering the real run relies on -- every request cut off by the death goes again (same request)
on the new engine, only after the owner has loaded the weights into it; the owner's own requests
(the probe) run during that revival; one restart however many requests saw the death; spent
restarts or a failed revival refuse every later request instead of sampling from a wrong engine.
The real engine: ``tests/integration/test_bench_chaos.py`` (kill_engine in a real run)."""

from __future__ import annotations

import asyncio
import signal
from types import SimpleNamespace

import pytest
from vllm.v1.engine.exceptions import EngineDeadError

from megathunder.config import EngineConfig
from megathunder.rollout.engines import inprocess
from megathunder.rollout.engines.inprocess import EngineRestartError, InProcessEngine
from megathunder.rollout.types import SamplingParams


class FakeLLM:
    """Answers each request with its prompt reversed once ``release`` is set; ``kill`` makes every
    request in flight and every later one raise EngineDeadError."""

    made: list[FakeLLM] = []

    def __init__(self) -> None:
        self.dead, self.release, self.loaded = False, asyncio.Event(), False
        # no processes to look at; an update pauses the scheduler here (as pause_generation would)
        self.engine_core = SimpleNamespace(resources=SimpleNamespace(engine_manager=None),
                                           pause_scheduler_async=self.pause_generation)
        self.requests: list[list[int]] = []
        FakeLLM.made.append(self)

    @classmethod
    def from_engine_args(cls, args, stat_loggers=()) -> FakeLLM:
        return cls()

    def get_num_unfinished_requests(self) -> int:
        return 0

    @property
    def errored(self) -> bool:
        return self.dead

    def kill(self) -> None:
        self.dead = True
        self.release.set()

    async def generate(self, prompt, params, request_id, priority=0):
        self.requests.append(list(prompt["prompt_token_ids"]))
        await self.release.wait()
        if self.dead:
            raise EngineDeadError()
        tokens = list(reversed(prompt["prompt_token_ids"]))
        yield SimpleNamespace(finished=True, num_cached_tokens=0, prompt_logprobs=[None] + [
            {t: SimpleNamespace(logprob=-2.0)} for t in prompt["prompt_token_ids"][1:]], outputs=[SimpleNamespace(
            token_ids=tokens, logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in tokens], finish_reason="length",
            weight_versions=[SimpleNamespace(version="1" if self.loaded else "0")])])

    async def update_weight_version(self, version: str) -> None:
        pass

    async def pause_generation(self, **kwargs) -> None:
        pass

    async def resume_generation(self) -> None:
        pass

    async def reset_prefix_cache(self) -> bool:
        return True

    async def collective_rpc(self, method, args=(), kwargs=None):
        return []

    def shutdown(self) -> None:
        self.dead = True


@pytest.fixture
def make_engine(monkeypatch):
    """An engine on a ``FakeLLM`` whose owner's ``revive`` hook (given at construction, as
    ``start_engine(revive=...)`` does) is ``revive``."""
    from vllm.v1.engine import async_llm

    monkeypatch.setattr(async_llm, "AsyncLLM", FakeLLM)
    FakeLLM.made = []

    def make(revive=None, max_restarts: int = 2, senders="engine", weight_transfer="rpc") -> InProcessEngine:
        eng = InProcessEngine(FakeLLM(), policy_version=0, senders=senders, revive=revive)  # type: ignore[arg-type]
        cfg = EngineConfig(weight_transfer=weight_transfer, max_restarts=max_restarts)
        eng._restart_with = (None, cfg)  # type: ignore[assignment]
        return eng

    return make


PARAMS = SamplingParams(max_new_tokens=4, seed=7)


def test_requests_cut_off_by_a_death_go_again_after_the_weights_are_loaded(make_engine):
    async def main():
        revived: list[int] = []

        async def revive(engine) -> None:  # the trainer: load the weights, then probe on the new engine
            new = FakeLLM.made[-1]
            new.loaded = True
            new.release.set()
            probe = await engine.generate([9, 8], PARAMS)  # must not wait for the revival it is part of
            revived.append(probe.policy_version)

        engine = make_engine(revive)
        first = FakeLLM.made[0]
        tasks = [asyncio.ensure_future(engine.generate([i, i + 1], PARAMS)) for i in range(5)]
        await asyncio.sleep(0.05)
        assert len(first.requests) == 5
        first.kill()
        done = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert [c.token_ids for c in done] == [[i + 1, i] for i in range(5)]
        assert all(c.policy_version == 1 for c in done)  # sampled only after the weights were loaded
        assert revived == [1] and engine.num_restarts == 1 and len(FakeLLM.made) == 2
        assert sorted(FakeLLM.made[1].requests) == sorted([[9, 8], *([i, i + 1] for i in range(5))])

    asyncio.run(main())


def test_spent_restarts_and_a_failed_revival_refuse_later_requests(make_engine):
    async def main():
        async def revive(engine) -> None:
            raise RuntimeError("probe gap 3.1e-1")

        engine = make_engine(revive)
        FakeLLM.made[0].kill()
        with pytest.raises(EngineRestartError, match="restart failed: probe gap"):
            await asyncio.wait_for(engine.generate([1], PARAMS), 10)
        with pytest.raises(EngineRestartError, match="restart failed"):  # never the unrevived engine
            await asyncio.wait_for(engine.generate([2], PARAMS), 10)
        assert FakeLLM.made[1].requests == []

    asyncio.run(main())


def test_no_restart_without_an_owner_or_past_max_restarts(make_engine):
    async def main():
        engine = make_engine()
        FakeLLM.made[0].kill()
        with pytest.raises(EngineRestartError, match="nothing can load its weights"):
            await asyncio.wait_for(engine.generate([1], PARAMS), 10)

    asyncio.run(main())

    async def no_owner_needed() -> None:
        fresh = make_engine(lambda engine: asyncio.sleep(0), max_restarts=0)
        FakeLLM.made[-1].kill()
        with pytest.raises(EngineRestartError, match="max_restarts=0 spent"):
            await asyncio.wait_for(fresh.generate([1], PARAMS), 10)

    asyncio.run(no_owner_needed())
    assert inprocess._REVIVING.get() is False


def test_an_engine_found_dead_as_a_weight_update_begins_is_restarted_first(make_engine, tmp_path):
    """The core died after its last requests had finished (a kill_engine that lands as the batch
    ends): no request sees it, so the next weight update does. Nothing is lost: the engine is
    started again in place and revived (the owner's current weights), and the update then goes to
    the new engine -- instead of the update failing on a dead one and the run stopping."""
    (tmp_path / "model.safetensors").touch()

    async def main():
        revived = []

        async def revive(engine) -> None:
            revived.append(len(FakeLLM.made))
            FakeLLM.made[-1].loaded = True

        engine = make_engine(revive)
        FakeLLM.made[0].kill()
        await asyncio.wait_for(engine.update_weights(str(tmp_path), policy_version=1), 10)
        assert revived == [2] and engine.num_restarts == 1 and engine.llm is FakeLLM.made[1]
        assert engine.policy_version == 1

    asyncio.run(main())


def test_an_engine_found_stopped_as_a_weight_update_begins_is_killed_and_restarted_first(make_engine, tmp_path):
    """A SIGSTOP that landed as the batch's last requests finished: at the next update the engine's
    processes are stopped (it could answer nothing), so it is SIGKILLed and restarted in place
    first, as a dead one -- not left to fail the update's pause after the stall timeout."""
    (tmp_path / "model.safetensors").touch()
    signals = []

    async def revive(engine) -> None:
        engine._core_stopped = lambda: False  # the new engine runs

    engine = make_engine(revive)
    engine._core_stopped = lambda: True  # type: ignore[method-assign]
    engine.signal_core = lambda sig: signals.append(sig) or []  # type: ignore[method-assign]

    async def main():
        await asyncio.wait_for(engine.update_weights(str(tmp_path), policy_version=1), 10)
        assert engine.num_restarts == 1 and engine.llm is FakeLLM.made[1] and engine.policy_version == 1

    asyncio.run(main())
    assert signals == [signal.SIGKILL]


def test_a_restarted_engine_the_learner_sends_to_gets_its_groups_from_its_owner(make_engine):
    """``senders="learner"``: the dead engine's transfer groups are dropped and the new engine opens
    none of its own; the ``revive`` hook is given the engine, whose groups are then closed
    (``transfer_open``): the owner's push connects the learner's stage senders anew."""

    class Groups:  # the dead engine's groups, every worker joined
        joined = True

    async def main():
        seen = []

        async def revive(engine) -> None:
            seen.append((engine, engine.transfer, engine.transfer_open))
            FakeLLM.made[-1].release.set()

        engine = make_engine(revive, senders="learner", weight_transfer="collective")
        engine.transfer = Groups()  # type: ignore[assignment]
        assert engine.transfer_open
        job = asyncio.ensure_future(engine.generate([1, 2], PARAMS))
        await asyncio.sleep(0.05)
        FakeLLM.made[0].kill()
        assert (await asyncio.wait_for(job, 10)).token_ids == [2, 1]
        assert seen == [(engine, None, False)]

    asyncio.run(main())


def test_busy_counts_a_request_from_its_call_not_from_the_engines_count(make_engine):
    """The generation hold reads ``busy``: a turn whose request the engine has not counted yet (here
    never: the stand-in's count is always 0) is in flight from its ``generate`` call to its return,
    so a learner pass does not start beside it (``megathunder.learner.pack_window``)."""

    async def go():
        eng = make_engine()
        assert not eng.busy()
        task = asyncio.ensure_future(eng.generate([1, 2, 3], PARAMS))
        await asyncio.sleep(0)
        assert eng.busy() and not eng.generating()
        eng.llm.release.set()
        await task
        assert not eng.busy()
        eng.llm.release.clear()
        failing = asyncio.ensure_future(eng.generate([4], PARAMS))
        await asyncio.sleep(0)
        assert eng.busy()
        eng._restart_failed = "gone"  # a request that ends in an error leaves the count too
        eng.llm.kill()
        with pytest.raises(EngineRestartError):
            await failing
        assert not eng.busy()

    asyncio.run(go())


def test_busy_counts_a_teacher_s_scoring_request_too(make_engine):
    """A prompt-logprob request (a teacher scoring a turn) takes the engine as a turn does: a
    learner pass does not start beside it while the engine has not counted it yet."""

    async def go():
        eng = make_engine()
        task = asyncio.ensure_future(eng.prompt_logprobs([5, 6, 7], 1))
        await asyncio.sleep(0)
        assert eng.busy() and not eng.generating()
        eng.llm.release.set()
        assert await task == ([-2.0, -2.0], 0)
        assert not eng.busy()

    asyncio.run(go())
