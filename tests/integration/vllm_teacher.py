"""An OPD teacher served by vLLM: per-turn scores from prompt logprobs with prefix caching.

Implements ``megathunder.streaming.opd_turns.Teacher`` over an in-process engine
(``InProcessEngine.prompt_logprobs``). When turn k of a trajectory completes, the request is the
whole trajectory so far; the blocks of it that the engine scored for turn k-1 come from vLLM's
prefix cache, so only the tail since the last full block (block_size tokens at most) and the new
tokens are computed. ``stats`` counts prompt tokens sent and tokens served from the cache.

The engine runs on its own asyncio loop (``loop``, e.g. in a background thread); ``score`` is a
blocking call from the learner's side.
"""

from __future__ import annotations

import asyncio

import torch


class VLLMTeacher:
    def __init__(self, engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0, "scored_tokens": 0}

    def score(self, traj_id: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        ids = [int(t) for t in tokens]
        call = self.engine.prompt_logprobs(ids, start)
        logps, cached = asyncio.run_coroutine_threadsafe(call, self.loop).result()
        self.stats["prompt_tokens"] += len(ids)
        self.stats["cached_tokens"] += cached
        self.stats["scored_tokens"] += len(ids) - start
        return torch.tensor(logps, dtype=torch.float32)

    def release(self, traj_id: int) -> None:
        """Nothing to free: the prefix cache is the engine's (evicted by LRU)."""
