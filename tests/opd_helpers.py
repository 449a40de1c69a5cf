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


def interleaved(num_parts: dict[int, int], rng: random.Random, rewards: bool = False):
    """Events of concurrent trajectories in a random interleaving, each in its own order:
    ``("part", tid, k)`` for k = 0 .. num_parts[tid] - 1, then ``("end", tid, None)``, and with
    ``rewards`` a ``("reward", tid, None)`` some time after its end."""
    cursors, awaiting = dict.fromkeys(num_parts, 0), []
    while cursors or awaiting:
        if awaiting and (not cursors or rng.random() < 0.3):
            yield "reward", awaiting.pop(rng.randrange(len(awaiting))), None
            continue
        tid = rng.choice(sorted(cursors))
        if cursors[tid] < num_parts[tid]:
            yield "part", tid, cursors[tid]
            cursors[tid] += 1
        if cursors[tid] == num_parts[tid]:
            yield "end", tid, None
            del cursors[tid]
            if rewards:
                awaiting.append(tid)


def feed_parts(target, tid: int, part) -> None:
    """One ``(kind, tokens)`` part of a random episode (after its prefix) to a streamer."""
    kind, toks = part
    (target.on_turn if kind == "turn" else target.on_tool_output)(tid, toks)


def stream(streamer, episodes, seed: int = 5) -> None:
    """Feed the episodes' events to a TurnStreamer, trajectories interleaved (they run
    concurrently), each in its own order."""
    for tid, parts in enumerate(episodes):
        streamer.begin_trajectory(tid, parts[0][1])
    for kind, tid, k in interleaved({tid: len(parts) - 1 for tid, parts in enumerate(episodes)},
                                    random.Random(seed)):
        if kind == "part":
            feed_parts(streamer, tid, episodes[tid][1 + k])
        else:
            streamer.end_trajectory(tid)
