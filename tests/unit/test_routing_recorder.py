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


def test_capture_writes_one_preallocated_buffer_and_the_rows_are_read_after_the_step():
    """Inside the forward ``capture`` only copies into the buffer allocated at start (the address a
    CUDA graph keeps: no allocation, no host sync); the step's rows are read when the next step is
    prepared, before its forward overwrites them -- so a later step's capture leaves them intact."""
    rec = RoutingRecorder(LAYERS, TOP_K, max_tokens=64)
    address = rec.device_rows.data_ptr()
    _step(rec, [("a", 0, [1, 2, 3], [1])])
    assert rec.device_rows[:3].tolist() == [_row(1, p) for p in range(3)]  # written in place
    _step(rec, [("a", 3, [1, 2, 3, 4], [1]), ("b", 0, [7, 8], [2])])  # overwrites rows 0..2 of the buffer
    assert rec.device_rows[:3].tolist() == [_row(1, 3), _row(2, 0), _row(2, 1)]
    assert rec.lookup([1, 2, 3, 4, 5]).tolist() == [_row(1, p) for p in range(4)]  # step 1 read before step 2
    assert rec.lookup([7, 8, 9]).tolist() == [_row(2, 0), _row(2, 1)]
    rec.clear()
    assert rec.device_rows.data_ptr() == address  # never reallocated, weights changing or not


def test_a_sibling_hitting_the_prefix_cache_at_the_failing_length_is_routed_everywhere():
    """The quickstart's failing shape, 98 input positions: a group sibling hits the prefix cache for
    the first 64 positions (4 blocks of 16) of a 90-token prompt and computes the rest; every one of
    its positions is routed, the cached ones with the rows of the request that computed them. The
    positions no request computed -- output appended after the last generation, which the agent loop
    no longer does -- stay missing, which is what the learner refused."""
    rec = RoutingRecorder(LAYERS, TOP_K, max_tokens=256)
    prompt = list(range(100, 190))  # 90 tokens
    _step(rec, [("a", 0, prompt, [1])])
    a_out = [7, 8, 9]
    for n in range(1, len(a_out) + 1):  # a decodes: each sampled token an input of the next step
        _step(rec, [("a", 90 + n - 1, prompt + a_out[:n], [1])])
    b_seq = prompt + [40, 41, 42, 43, 44, 45, 46, 47]  # b: 64 cached, the rest computed, then decoded
    _step(rec, [("b", 64, b_seq[:90], [2])])
    for n in range(91, len(b_seq) + 1):
        _step(rec, [("b", n - 1, b_seq[:n], [2])])
    out = rec.lookup(b_seq + [2])  # 99 tokens: 98 input positions
    assert out.shape == (98, LAYERS, TOP_K) and not (out == MISSING).any()
    assert out.tolist() == [_row(1, p) for p in range(64)] + [_row(2, p) for p in range(64, 98)]
    appended = rec.lookup(b_seq + [2, 60, 61, 62])  # tokens after the last generation: never computed
    assert (appended[:98] == out).all() and (appended[98:] == MISSING).all()


def test_recording_needs_synchronous_scheduling():
    """Under async scheduling the runner prepares a step before the last one's sampled tokens reach
    the host: the rows could not be attributed to their tokens, so install refuses -- and
    megathunder's engines turn async scheduling off whenever they record."""
    from types import SimpleNamespace

    import pytest

    from megathunder.config import EngineConfig
    from megathunder.rollout.engines.common import engine_kwargs
    from megathunder.rollout.engines.routing_capture import install_on_runner
    from megathunder.rollout.engines.server import server_command

    runner = SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=True)))
    with pytest.raises(RuntimeError, match="synchronous scheduling"):
        install_on_runner(runner)
    assert engine_kwargs(EngineConfig(record_routing=True))["async_scheduling"] is False
    assert "async_scheduling" not in engine_kwargs(EngineConfig())  # vLLM's default otherwise
    assert "--no-async-scheduling" in server_command("/m", EngineConfig(deployment="server", record_routing=True), 8000)


def test_the_recorder_is_bound_when_the_model_is_loaded(monkeypatch):
    """Before vLLM compiles the model and captures CUDA graphs (which come after ``load_model``), so
    the graphs' forwards call the capture hooks too; the worker extension's start then finds it."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_worker import Worker

    from megathunder.config import EngineConfig
    from megathunder.rollout.engines import routing_capture, vllm_plugin

    calls = []
    monkeypatch.setattr(Worker, "load_model", lambda self, **kw: calls.append("load"))
    monkeypatch.setattr(Worker, "megathunder_records_routing", False, raising=False)
    monkeypatch.setattr(routing_capture, "install_on_runner", lambda runner: calls.append(("install", runner)))
    for name, value in vllm_plugin.environment(EngineConfig(record_routing=True)).items():
        monkeypatch.setenv(name, value)
    vllm_plugin.register()
    worker = SimpleNamespace(model_runner="runner")
    Worker.load_model(worker, load_dummy_weights=False)
    assert calls == ["load", ("install", "runner")]
    assert vllm_plugin.environment(EngineConfig())[vllm_plugin.ROUTING_ENV] == ""  # others untouched
