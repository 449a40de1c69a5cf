"""The zero-staleness probe: two checks that vLLM samples from the weights being trained.

After every weight push vLLM scores a fixed token sequence -- the probe's prompt and a
continuation of ``probe.tokens`` tokens that vLLM sampled once, at the run's temperature,
when the probe was calibrated -- in one prefill, and samples one token after it (``engine_probe``):
the logprobs of the continuation and of that token, of softmax(logits) (temperature 1: vLLM's
prompt logprobs apply no sampling processor). The learner scores the same tokens at temperature 1.
One prefill instead of ``probe.tokens`` decode steps: on SmolLM2-135M on a CPU ~0.25 s instead of
~1.7 s a push (BENCHMARKS.md, `megathunder bench probe`).

1. **vLLM moved with the learner.** Every push ends with the same probe request (same tokens, same
   seed, no cached prefix read -- vLLM reads none for a request that asks for prompt logprobs): an
   engine that kept its weights computes bit-identical logprobs and samples the same token. So if
   vLLM's tokens and logprobs are exactly the previous push's while the learner's logprobs of
   them changed, the push did not load the new weights -- whatever the numerics, bf16 included.
   (Requests batched alongside the probe -- fully_async -- can change vLLM's low bits: that makes
   the check miss a stale push, never stop a good run.)
2. **vLLM agrees with the learner, up to numerics.** The gap of a push is the largest per-token
   |logprob difference|: other kernels, other summation orders and, with bf16, rounding. When the
   probe is calibrated both sides hold the same weights, and ``probe.calibration_probes``
   other continuations (sampled with other seeds), scored the same way, give the noise floor f0,
   the largest gap numerics alone caused. A push fails when

       gap > tau = max(probe.tolerance, probe.noise_margin * f0)

   A later probe's gap is the max of its n token errors and f0 the max of the calibration's K * n;
   with exchangeable errors a later max would exceed f0 with probability up to 1 / (K + 1), so tau
   needs a margin: ``megathunder bench probe`` measures the ratio gap / f0 over hundreds of probes on
   the same and on updated weights (BENCHMARKS.md, `megathunder bench probe`); the default margin is about three
   times the largest ratio seen. Once a push has passed both checks its gap is numerics on the new
   weights, so the floor becomes the largest of f0 and the gaps accepted so far (bf16 rounding grows
   with the logits' scale as training moves them) -- but never more than ``margin * f0``: a floor
   that followed every accepted gap could grow by the margin at each push, and a slowly worsening
   engine would raise its own tolerance; so tau <= margin^2 * f0 (a floor that grew 4x over a bf16
   run was measured: `megathunder bench probe`). This check catches wrong or partly loaded
   weights; it cannot see a stale push whose update moves the policy by less than tau, which check 1
   does. The tolerance of every push is reported with its gap (``probe_tolerance`` in metrics.jsonl).

A floor above ``probe.max_noise_floor`` is not numerics: the engine and the learner compute
different models (RoPE, vocabulary, layout), and the run stops at its first push. The decode path
and the temperature are checked once, at calibration: vLLM's logprobs of each calibration
continuation as it sampled it (at the run's temperature) must be within tau of the learner's
softmax(logits / T) -- an engine sampling another distribution than the one trained stops the run
(on SmolLM2-135M, 16 tokens sampled at T = 0.7 and scored at 0.8 or 1.0 move by up to 0.41 and
1.35: 400x and 1350x fp32's tau; in bf16 tau is ~1.5 and a small mismatch can hide under it).
Measured: the sampled gaps are 1-2x the scored floor (``bench probe``), so the check has margin.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from megathunder.config import ProbeConfig
from megathunder.rollout.types import Completion, RolloutEngine, RoutingSource, SamplingParams


PROBE_SEED = 0  # the seed of the probe's continuation and of the request every push ends with (check 1)
PROBE_SESSION = "probe"  # its session: servers' routing is read from the one that served it


class StaleWeightsError(RuntimeError):
    """The rollout engine's logprobs do not match the learner's after a weight sync."""


def max_logprob_gap(engine_logp: Sequence[float], learner_logp: torch.Tensor) -> float:
    return float((torch.tensor(list(engine_logp), dtype=torch.float64) - learner_logp.double()).abs().max())


@dataclass
class ProbeTolerance:
    """``tau = max(minimum, margin * floor)``; the floor is set once, from same-weights probes."""

    minimum: float
    margin: float
    floor: float | None = None  # None until calibrated
    calibrated: float | None = None  # f0: the floor measured on the same weights

    def calibrate(self, gaps: Sequence[float]) -> None:
        if not gaps:
            raise ValueError("calibration needs at least one probe")
        self.floor = self.calibrated = max(gaps)

    def accept(self, gap: float) -> None:
        """A push both checks passed: its gap is numerics on the new weights, so the floor follows
        the weights (bf16 rounding grows with the logits' scale as training moves them), up to
        ``margin`` times the calibrated floor."""
        if self.floor is None or self.calibrated is None:
            self.floor = gap
            return
        self.floor = max(self.floor, min(gap, self.margin * self.calibrated))

    @property
    def value(self) -> float:
        return self.minimum if self.floor is None else max(self.minimum, self.margin * self.floor)


@dataclass(frozen=True)
class ProbeSample:
    """One fixed-seed probe: vLLM's tokens and logprobs, and the learner's logprobs of the tokens."""

    tokens: tuple[int, ...]
    engine_logprobs: tuple[float, ...]
    learner_logprobs: torch.Tensor


def engine_kept_its_weights(previous: ProbeSample | None, current: ProbeSample) -> bool:
    """vLLM repeated the previous push's probe bit for bit although the learner's logprobs of those
    tokens moved: it still samples from the weights before the update."""
    if previous is None or previous.tokens != current.tokens or previous.engine_logprobs != current.engine_logprobs:
        return False
    return not torch.equal(previous.learner_logprobs, current.learner_logprobs)


@dataclass(frozen=True)
class EngineProbe:
    """vLLM's side of one probe: the tokens after the prompt (the continuation, then the token
    sampled after it), their logprobs at temperature 1, and the policy version that computed them."""

    tokens: list[int]
    logprobs: list[float]
    policy_version: int


async def engine_probe(engine: RolloutEngine, prompt: Sequence[int], continuation: Sequence[int],
                       seed: int = PROBE_SEED) -> EngineProbe:
    """One request: ``prompt + continuation`` scored in one prefill (no cached prefix read) and one
    token sampled after it, all at temperature 1."""
    params = SamplingParams(max_new_tokens=1, temperature=1.0, seed=seed, ignore_eos=True,
                            prompt_logprobs_from=len(prompt))
    out = await engine.generate(list(prompt) + list(continuation), params, session_id=PROBE_SESSION)
    if out.prompt_logprobs is None:
        raise RuntimeError(f"{type(engine).__name__} returned no prompt logprobs (SamplingParams.prompt_logprobs_from)")
    return EngineProbe(list(continuation) + list(out.token_ids), list(out.prompt_logprobs) + list(out.logprobs),
                       out.policy_version)


@dataclass(frozen=True)
class _EngineSide:
    """vLLM's part of one probe: the tokens after the prompt, their logprobs, the routed experts."""

    version: int
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    routed: torch.Tensor | None


class Scorer(Protocol):
    """The learner's side of the probe (``megathunder.learner.client.LearnerClient.score``)."""

    async def score(self, tokens: list[int], prompt_len: int, routed_experts: torch.Tensor | None = None,
                    temperature: float | None = None) -> torch.Tensor: ...


class Probe:
    """The probe of every push (module docstring): ``check`` runs it whole; ``start`` runs vLLM's
    part now and returns the learner's part as a task (``probe.overlap``), whose result is the
    push's gap and which raises ``StaleWeightsError`` when the push is stale. The first probe
    calibrates the noise floor. ``prompt``: the probe's prompt tokens; ``temperature`` and
    ``processed_logprobs``: how the run samples (``rollout.temperature``,
    ``rollout.engine.logprobs_mode``); ``routing``: the engine's recorded routing (routing replay)."""

    def __init__(self, engine: RolloutEngine, learner: Scorer, prompt: Sequence[int], cfg: ProbeConfig,
                 temperature: float, processed_logprobs: bool, routing: RoutingSource | None = None) -> None:
        self.engine, self.learner, self.prompt, self.cfg = engine, learner, list(prompt), cfg
        self.temperature, self.processed_logprobs, self.routing = temperature, processed_logprobs, routing
        self.tolerance = ProbeTolerance(cfg.tolerance, cfg.noise_margin)
        self.last_gap = float("nan")  # the last checked push's
        self.last_gap_own_routing = float("nan")  # routing replay: the same probe without it
        self._last: ProbeSample | None = None
        self._continuation: list[int] | None = None  # the tokens every push's probe scores

    @property
    def enabled(self) -> bool:
        return self.cfg.tokens > 0

    @property
    def calibrated(self) -> bool:
        return self.tolerance.floor is not None

    async def check(self, version: int, unchanged: bool = False) -> float:
        """The whole probe of the push of ``version`` (calibrating first, the first time); its gap.
        ``unchanged``: no weight moved in the inference dtype at that push (vLLM may then repeat
        the previous probe bit for bit)."""
        if not self.enabled:
            return float("nan")
        if not self.calibrated:
            await self._calibrate(version)
        return await self._checked(await self._engine_side(version), unchanged)

    async def start(self, version: int, unchanged: bool = False) -> asyncio.Task[float]:
        """vLLM's part of the probe now (alone: nothing else generates); the learner's part as a
        task that returns the gap (or raises ``StaleWeightsError``). Needs a calibrated probe."""
        if not self.calibrated:
            raise RuntimeError("Probe.start: calibrate first (Probe.check)")
        side = await self._engine_side(version)
        self.last_gap = float("nan")
        return asyncio.create_task(self._checked(side, unchanged))

    async def check_revived(self, version: int) -> float:
        """A restarted engine, loaded with the learner's weights of ``version``: its gap to the
        learner on the push's probe (no comparison with the previous push: same weights)."""
        gap = _gap(await self._learner_side(await self._engine_side(version)))
        if gap > self.tolerance.value:
            raise StaleWeightsError(f"the restarted engine's logprobs differ from the learner's by {gap:.3e} (> "
                                    f"{self.tolerance.value:.3e}): it is not sampling from the weights being trained")
        return gap

    def columns(self) -> dict[str, float]:
        """The last checked push's figures for the metrics row."""
        return {"probe_gap": self.last_gap, "probe_tolerance": self.tolerance.value,
                **({"probe_gap_own_routing": self.last_gap_own_routing} if self.routing else {})}

    async def _checked(self, side: _EngineSide, unchanged: bool) -> float:
        """The learner's logprobs of vLLM's probe, then both checks; returns the push's gap."""
        sample, previous = await self._learner_side(side), self._last
        if previous is not None and not unchanged and engine_kept_its_weights(previous, sample):
            moved = float((sample.learner_logprobs - previous.learner_logprobs).abs().max())
            raise StaleWeightsError(
                f"after the weight sync of policy version {side.version}: vLLM computed the previous push's probe "
                f"bit for bit while the learner's logprobs of it moved by {moved:.3e}; the engine is not "
                "sampling from the weights being trained")
        self._last = sample
        gap = _gap(sample)
        tau = self.tolerance
        if gap > tau.value:
            raise StaleWeightsError(
                f"after the weight sync of policy version {side.version}: vLLM's logprobs differ from the "
                f"learner's by {gap:.3e} (> {tau.value:.3e} = max(probe.tolerance, probe.noise_margin x the "
                f"noise floor {tau.floor:.2e})); the engine is not sampling from the weights being trained")
        tau.accept(gap)
        self.last_gap = gap
        return gap

    async def _calibrate(self, version: int) -> None:
        """The noise floor, on the same weights: other continuations scored the probe's way. A floor
        above ``probe.max_noise_floor`` is not numerics. Then the decode path, once: vLLM's logprobs
        of its own samples against the learner's at the run's temperature (of the unscaled logits
        under ``logprobs_mode: raw_logprobs``) must be within the tolerance too."""
        cfg = self.cfg
        sampled_at = self.temperature if self.processed_logprobs else 1.0
        scored, sampled = [], []
        for k in range(cfg.calibration_probes):
            draw = await self._draw(seed=1 + k)
            scored.append(_gap(await self._learner_side(await self._engine_side(version, draw.token_ids))))
            tokens = self.prompt + draw.token_ids  # the probe's prefill computed (and routed) every position
            learner = await self.learner.score(tokens, len(self.prompt), await self._routed(tokens), sampled_at)
            sampled.append(max_logprob_gap(draw.logprobs, learner))
        self.tolerance.calibrate(scored)
        if max(scored) > cfg.max_noise_floor:
            raise StaleWeightsError(
                f"on the same weights vLLM's logprobs differ from the learner's by {max(scored):.3e} (> "
                f"probe.max_noise_floor={cfg.max_noise_floor:g}): not numerics; the engine "
                "and the learner compute different models (RoPE scaling, vocabulary, layout?)")
        if max(sampled) > self.tolerance.value:
            raise StaleWeightsError(
                f"vLLM's logprobs of its own samples differ from the learner's softmax(logits / {sampled_at:g}) by "
                f"{max(sampled):.3e} (> the probe's tolerance {self.tolerance.value:.3e}) while its scores of "
                "the same tokens agree: the engine samples another distribution than the one trained (temperature?)")

    async def _draw(self, seed: int) -> Completion:
        """``probe.tokens`` tokens vLLM samples after the probe's prompt at the run's temperature."""
        params = SamplingParams(max_new_tokens=self.cfg.tokens, temperature=self.temperature, seed=seed,
                                ignore_eos=True)
        return await self.engine.generate(self.prompt, params, session_id=PROBE_SESSION)

    async def _engine_side(self, version: int, continuation: Sequence[int] | None = None) -> _EngineSide:
        """vLLM's part of a probe: one prefill of the prompt and ``continuation`` (default: the
        push's own, drawn with ``PROBE_SEED`` the first time) and one sampled token, with the
        experts it routed to under routing replay. ``version``: the weights vLLM must have."""
        if continuation is None:
            if self._continuation is None:
                self._continuation = (await self._draw(seed=PROBE_SEED)).token_ids
            continuation = self._continuation
        out = await engine_probe(self.engine, self.prompt, continuation)
        if out.policy_version != version:
            raise StaleWeightsError(f"after the weight sync of policy version {version}: vLLM sampled with "
                                    f"version {out.policy_version}")
        tokens = self.prompt + out.tokens
        return _EngineSide(version, self.prompt, out.tokens, out.logprobs, await self._routed(tokens))

    async def _learner_side(self, side: _EngineSide) -> ProbeSample:
        """The learner's logprobs of the tokens vLLM probed (routed as vLLM routed them under
        routing replay; the gap without replay is reported beside it)."""
        tokens = side.prompt + side.tokens
        if side.routed is not None:
            own = await self.learner.score(tokens, len(side.prompt), None, 1.0)
            self.last_gap_own_routing = max_logprob_gap(side.logprobs, own)
        learner_logp = await self.learner.score(tokens, len(side.prompt), side.routed, 1.0)
        return ProbeSample(tuple(side.tokens), tuple(side.logprobs), learner_logp)

    async def _routed(self, tokens: list[int]) -> torch.Tensor | None:
        """Routing replay: the experts vLLM's probe request routed ``tokens`` to (None without it)."""
        if self.routing is None:
            return None
        return torch.from_numpy((await self.routing.routed_experts(tokens, session_id=PROBE_SESSION)).copy())


def _gap(sample: ProbeSample) -> float:
    return max_logprob_gap(sample.engine_logprobs, sample.learner_logprobs)
