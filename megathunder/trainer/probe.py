"""The zero-staleness probe: two checks that vLLM samples from the weights being trained.

After every weight push vLLM scores a fixed token sequence -- the probe's prompt and a
continuation of ``schedule.probe_tokens`` tokens that vLLM sampled once, at the run's temperature,
when the probe was calibrated -- in one prefill, and samples one token after it (``engine_probe``):
the logprobs of the continuation and of that token, of softmax(logits) (temperature 1: vLLM's
prompt logprobs apply no sampling processor). The learner scores the same tokens at temperature 1.
One prefill instead of ``probe_tokens`` decode steps: on SmolLM2-135M on a CPU ~0.25 s instead of
~1.7 s a push (BENCHMARKS.md, "the probe").

1. **vLLM moved with the learner.** Every push ends with the same probe request (same tokens, same
   seed, no cached prefix read -- vLLM reads none for a request that asks for prompt logprobs): an
   engine that kept its weights computes bit-identical logprobs and samples the same token. So if
   vLLM's tokens and logprobs are exactly the previous push's while the learner's logprobs of
   them changed, the push did not load the new weights -- whatever the numerics, bf16 included.
   (Requests batched alongside the probe -- fully_async -- can change vLLM's low bits: that makes
   the check miss a stale push, never stop a good run.)
2. **vLLM agrees with the learner, up to numerics.** The gap of a push is the largest per-token
   |logprob difference|: other kernels, other summation orders and, with bf16, rounding. When the
   probe is calibrated both sides hold the same weights, and ``schedule.probe_calibration_probes``
   other continuations (sampled with other seeds), scored the same way, give the noise floor f0,
   the largest gap numerics alone caused. A push fails when

       gap > tau = max(schedule.probe_tolerance, schedule.probe_noise_margin * f0)

   A later probe's gap is the max of its n token errors and f0 the max of the calibration's K * n;
   with exchangeable errors a later max would exceed f0 with probability up to 1 / (K + 1), so tau
   needs a margin: ``megathunder bench probe`` measures the ratio gap / f0 over hundreds of probes on
   the same and on updated weights (BENCHMARKS.md, "probe noise"); the default margin is about three
   times the largest ratio seen. Once a push has passed both checks its gap is numerics on the new
   weights, so the floor becomes the largest of f0 and the gaps accepted so far (bf16 rounding grows
   with the logits' scale as training moves them) -- but never more than ``margin * f0``: a floor
   that followed every accepted gap could grow by the margin at each push, and a slowly worsening
   engine would raise its own tolerance; so tau <= margin^2 * f0 (a floor that grew 4x over a bf16
   run was measured: BENCHMARKS.md). This check catches wrong or partly loaded
   weights; it cannot see a stale push whose update moves the policy by less than tau, which check 1
   does. The tolerance of every push is reported with its gap (``probe_tolerance`` in metrics.jsonl).

A floor above ``schedule.probe_max_noise_floor`` is not numerics: the engine and the learner compute
different models (RoPE, vocabulary, layout), and the run stops at its first push. The decode path
and the temperature are checked once, at calibration: vLLM's logprobs of each calibration
continuation as it sampled it (at the run's temperature) must be within tau of the learner's
softmax(logits / T) -- an engine sampling another distribution than the one trained stops the run
(on SmolLM2-135M, 16 tokens sampled at T = 0.7 and scored at 0.8 or 1.0 move by up to 0.41 and
1.35: 400x and 1350x fp32's tau; in bf16 tau is ~1.5 and a small mismatch can hide under it).
Measured: the sampled gaps are 1-2x the scored floor (``bench probe``), so the check has margin.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megathunder.rollout.types import RolloutEngine, SamplingParams


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
