"""A scripted policy for tests and benchmarks: a ``RolloutEngine`` that plays fixed assistant
turns through a real tokenizer. It is not a model and learns nothing.

Each episode's script is looked up by the user message found in the prompt it is given; the
turn index is the number of generation headers in the prompt. A turn's text is tokenised with the
template's special tokens (``<tool_call>`` as the single token a Qwen model would emit) and ends
with the codec's end-of-turn token. Logprobs are a deterministic function of the token id, so tests can check
that each lands on its own target position. ``seconds_per_token`` simulates decode time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Mapping, Sequence

from megathunder.rollout.chat import ChatCodec
from megathunder.rollout.types import Completion, FinishReason, SamplingParams, WeightSource


def scripted_logprob(token_id: int) -> float:
    return -0.05 * (1 + token_id % 13)


class ScriptedPolicy:
    def __init__(
        self,
        codec: ChatCodec,
        scripts: Mapping[str, Sequence[str]],  # first user message -> assistant turn texts
        *,
        seconds_per_token: float = 0.0,
        policy_version: int = 0,
    ) -> None:
        self.codec, self.scripts = codec, dict(scripts)
        self._by_length = sorted(self.scripts, key=len, reverse=True)  # the longest user message that matches
        self.seconds_per_token = seconds_per_token
        self.policy_version = policy_version
        self.num_calls = 0

    def _turn_text(self, prompt_ids: Sequence[int]) -> str:
        text = self.codec.decode(prompt_ids)
        user = next((u for u in self._by_length if u in text), None)
        if user is None:
            raise KeyError(f"scripted policy has no script for the prompt {text[-120:]!r}")
        turn = text.count(self.codec.generation_header) - 1
        script = self.scripts[user]
        return script[turn] if turn < len(script) else "I am done."

    async def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, *, session_id: Hashable | None = None
    ) -> Completion:
        self.num_calls += 1
        ids = self.codec.encode_trusted(self._turn_text(prompt_token_ids)) + [self.codec.end_of_turn_id]
        finish: FinishReason = "stop"
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
        if self.seconds_per_token:
            await asyncio.sleep(self.seconds_per_token * len(ids))
        else:
            await asyncio.sleep(0)
        return Completion(ids, [scripted_logprob(t) for t in ids], finish, self.policy_version)

    async def update_weights(self, weights: WeightSource, policy_version: int) -> None:
        self.policy_version = policy_version

    async def reset_prefix_cache(self) -> None:
        pass

    async def close(self) -> None:
        pass
