"""Multi-turn OPD episodes for the per-turn streaming tests (torch decoder and Megatron learner)."""

from __future__ import annotations

import random

import torch


def random_episode(rng: random.Random, vocab: int) -> list[tuple[str, list[int]]]:
    """[prompt, a_1, o_1, ..., a_K] with 1-8 turns, some empty turns and empty tool outputs."""
    tok = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    parts = [("prompt", tok(rng.randint(1, 4)))]
    num_turns = rng.randint(1, 8)
    for k in range(num_turns):
        parts.append(("turn", tok(rng.choice([0, 1, 2, 3]))))
        if k + 1 < num_turns:
            parts.append(("tool", tok(rng.choice([0, 0, 1, 2]))))
    return parts


def flatten(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [L], trained-target mask [L-1])."""
    tokens, trained = [], []
    for kind, toks in parts:
        tokens += toks
        trained += [kind == "turn"] * len(toks)
    return torch.tensor(tokens), torch.tensor(trained[1:], dtype=torch.bool)


def stream(streamer, episodes, seed: int = 5) -> None:
    """Feed the episodes' events to a TurnStreamer, trajectories interleaved (they run
    concurrently), each in its own order."""
    for tid, parts in enumerate(episodes):
        streamer.begin_trajectory(tid, parts[0][1])
    cursors = {tid: 1 for tid in range(len(episodes))}
    rng = random.Random(seed)
    while cursors:
        tid = rng.choice(sorted(cursors))
        if cursors[tid] < len(episodes[tid]):
            kind, toks = episodes[tid][cursors[tid]]
            (streamer.on_turn if kind == "turn" else streamer.on_tool_output)(tid, toks)
            cursors[tid] += 1
        if cursors[tid] == len(episodes[tid]):
            streamer.end_trajectory(tid)
            del cursors[tid]
