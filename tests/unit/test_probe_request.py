"""The probe's request (``megathunder.trainer.probe.engine_probe``) and how both deployments read
vLLM's prompt logprobs (``megathunder.rollout.engines.common.scored_prompt``)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megathunder.rollout.engines.common import scored_prompt
from megathunder.rollout.types import Completion, SamplingParams
from megathunder.trainer.probe import PROBE_SESSION, engine_probe


class Recorder:
    """An engine that answers the probe's request as vLLM would and records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[list[int], SamplingParams, object]] = []

    async def generate(self, prompt_token_ids, params, *, session_id=None) -> Completion:
        self.asked.append((list(prompt_token_ids), params, session_id))
        start = params.prompt_logprobs_from
        scored = [-0.1 * t for t in prompt_token_ids[start:]]
        return Completion([7], [-0.7], "length", policy_version=3, prompt_logprobs=scored)


def test_the_probe_scores_prompt_and_continuation_in_one_request_at_temperature_one():
    engine = Recorder()
    out = asyncio.run(engine_probe(engine, [1, 2, 3], [4, 5], seed=11))
    (tokens, params, session), = engine.asked
    assert tokens == [1, 2, 3, 4, 5] and session == PROBE_SESSION
    assert (params.max_new_tokens, params.temperature, params.seed, params.prompt_logprobs_from) == (1, 1.0, 11, 3)
    assert (params.top_p, params.top_k) == (1.0, -1)  # nothing processes the distribution
    assert out.tokens == [4, 5, 7] and out.logprobs == pytest.approx([-0.4, -0.5, -0.7]) and out.policy_version == 3


def test_an_engine_without_prompt_logprobs_is_a_clear_error():
    class NoScores:
        async def generate(self, prompt_token_ids, params, *, session_id=None) -> Completion:
            return Completion([7], [-0.7], "length", policy_version=0)

    with pytest.raises(RuntimeError, match="NoScores returned no prompt logprobs"):
        asyncio.run(engine_probe(NoScores(), [1, 2], [3]))  # type: ignore[arg-type]


class Lp:
    def __init__(self, logprob: float) -> None:
        self.logprob = logprob


def test_prompt_logprobs_are_read_from_vllms_objects_and_from_its_json():
    prompt = [5, 6, 7, 8]
    objects = [None, {6: Lp(-1.0)}, {7: Lp(-2.0), 1: Lp(-0.1)}, {8: Lp(-3.0)}]
    assert scored_prompt(prompt, 2, objects, lambda lp: lp.logprob) == [-2.0, -3.0]
    as_json = [None, {"6": {"logprob": -1.0}}, {"7": {"logprob": -2.0}, "1": {"logprob": -0.1}}, {"8": {"logprob": -3.0}}]
    assert scored_prompt(prompt, 2, as_json, lambda lp: lp["logprob"], keys=str) == [-2.0, -3.0]
    with pytest.raises(RuntimeError, match="cached prefix"):  # vLLM leaves positions read from the cache empty
        scored_prompt(prompt, 2, [None, None, None, {8: Lp(-3.0)}], lambda lp: lp.logprob)
    with pytest.raises(RuntimeError, match="returned 3 entries"):
        scored_prompt(prompt, 2, objects[:3], lambda lp: lp.logprob)


class TemperedLearner:
    """The learner of a fake model whose logit of token t is -t / 10: its logprob of t at temperature
    T is taken as -t / (10 T) (the score call the ``Probe`` makes: tokens, prompt length, routing, T)."""

    async def score(self, tokens, prompt_len, routed_experts=None, temperature=None):
        return torch.tensor([-0.1 * t / temperature for t in tokens[prompt_len:]], dtype=torch.float64)


class TemperedEngine:
    """The same fake model in the engine: samples at ``sample_temperature``, scores (prompt logprobs)
    at temperature 1, as vLLM does."""

    def __init__(self, sample_temperature: float) -> None:
        self.sample_temperature = sample_temperature

    async def generate(self, prompt_token_ids, params, *, session_id=None) -> Completion:
        start = params.prompt_logprobs_from
        if start is not None:  # the probe's request
            return Completion([7], [-0.7], "length", 0, prompt_logprobs=[-0.1 * t for t in prompt_token_ids[start:]])
        tokens = [3 + (params.seed + k) % 5 for k in range(params.max_new_tokens)]
        return Completion(tokens, [-0.1 * t / self.sample_temperature for t in tokens], "length", 0)


def _calibrated_probe(engine_samples_at: float, *overrides: str):
    from megathunder.config import load_config
    from megathunder.trainer.probe import Probe

    cfg = load_config(None, ["rollout.temperature=0.8", *overrides])
    probe = Probe(TemperedEngine(engine_samples_at), TemperedLearner(), [1, 2, 3], cfg.probe, cfg.rollout.temperature,
                  cfg.rollout.engine.logprobs_mode == "processed_logprobs")
    asyncio.run(probe.check(version=0))  # the first check calibrates
    return probe


def test_calibration_stops_an_engine_that_samples_at_another_temperature():
    from megathunder.trainer.probe import StaleWeightsError

    assert _calibrated_probe(0.8).tolerance.floor <= 1e-15  # the fake's scores agree up to rounding
    _calibrated_probe(1.0, "rollout.engine.logprobs_mode=raw_logprobs")  # raw: of the unscaled logits
    with pytest.raises(StaleWeightsError, match="samples another distribution"):
        _calibrated_probe(1.0)  # its samples' logprobs are of T = 1, the learner trains T = 0.8
