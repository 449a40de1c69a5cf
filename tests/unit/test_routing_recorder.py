"""The engine-side routing recorder (``megathunder.rollout.engines.routing_capture``) without vLLM: steps laid
out as vLLM's runner lays them out (requests in order, each its new positions), rows filed under their
token prefixes, looked up for a trajectory's input positions."""

from __future__ import annotations

import numpy as np
import torch

from megathunder.rollout.engines.routing_capture import MISSING, RoutingRecorder

LAYERS, TOP_K = 2, 2


def _row(request: int, position: int) -> list[list[int]]:
    """A distinct, recognisable routing per (request, position)."""
    return [[request, position], [position, request + 10]]


def _step(rec: RoutingRecorder, steps: list[tuple[str, int, list[int], list[int]]]) -> None:
    """steps: (request, start, all tokens so far incl. the new ones, its id for the rows)."""
    plan, rows = [], []
    for request, start, tokens, rid in steps:
        prefix = np.array(tokens[:start]) if rec.needs_prefix(request, start) else None
        plan.append((request, start, np.array(tokens[start:]), prefix))
        rows += [_row(rid[0], p) for p in range(start, len(tokens))]
    rec.begin_step(plan)
    ids = torch.tensor(rows, dtype=torch.int64)  # [tokens of the step, layers, top_k]
    for layer in range(LAYERS):
        rec.capture(layer, ids[:, layer])


def test_prefill_then_decode_rows_cover_every_input_position():
    rec = RoutingRecorder(LAYERS, TOP_K, max_tokens=64)
    prompt = [5, 6, 7, 8]
    _step(rec, [("a", 0, prompt, [1])])  # prefill: positions 0..3
    _step(rec, [("a", 4, prompt + [9], [1])])  # decode: the sampled 9 is position 4's input
    out = rec.lookup(prompt + [9, 11])  # 11: sampled last, never an input
    assert out.shape == (5, LAYERS, TOP_K)
    assert out.tolist() == [_row(1, p) for p in range(5)]


def test_a_cached_prefix_reads_the_rows_of_the_request_that_computed_it():
    """A sibling with the same prompt hits the prefix cache (vLLM computes only its tail); the next
    turn of an episode resends its history. Both find the earlier computation's rows."""
    rec = RoutingRecorder(LAYERS, TOP_K, max_tokens=64)
    prompt = [5, 6, 7, 8, 9, 10]
    _step(rec, [("a", 0, prompt, [1])])
    _step(rec, [("b", 4, prompt[:4] + [20, 21], [2]), ("a", 6, prompt + [30], [1])])  # b: 4 cached tokens
    b = rec.lookup(prompt[:4] + [20, 21, 22])
    assert b.tolist() == [_row(1, p) for p in range(4)] + [_row(2, 4), _row(2, 5)]
    # a's next turn: its history plus a tool response, all but the new tokens cached
    turn2 = prompt + [30, 31, 40, 41]
    _step(rec, [("a2", 7, turn2, [3])])
    assert rec.lookup(turn2 + [50]).tolist() == [_row(1, p) for p in range(7)] + [_row(3, p) for p in range(7, 10)]


def test_positions_never_computed_are_missing_and_a_clear_forgets_everything():
    rec = RoutingRecorder(LAYERS, TOP_K, max_tokens=64)
    _step(rec, [("a", 0, [1, 2, 3], [1])])
    other = rec.lookup([1, 2, 4, 5])  # diverges at position 2
    assert other[:2].tolist() == [_row(1, 0), _row(1, 1)] and (other[2:] == MISSING).all()
    rec.clear()  # the weights changed
    assert (rec.lookup([1, 2, 3]) == MISSING).all()


def test_the_trie_grows_past_its_first_allocation():
    rec = RoutingRecorder(LAYERS, TOP_K, max_tokens=4096)
    tokens = list(range(3000))
    _step(rec, [("a", 0, tokens, [7])])
    out = rec.lookup(tokens)
    assert out.shape == (2999, LAYERS, TOP_K) and out[-1].tolist() == _row(7, 2998)
