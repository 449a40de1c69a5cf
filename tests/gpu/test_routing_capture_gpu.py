"""The routing recorder's capture inside a CUDA graph (``tools/gpu_check.sh``); skipped on CPU.

vLLM captures its decode forwards as CUDA graphs, and the recorder's hooks are in them (bound at
model load, ``megathunder.rollout.engines.vllm_plugin``): inside the graph ``capture`` is a
device-to-device copy into the buffer allocated at start -- nothing allocated, nothing read on
the host -- so the capture succeeds and every replay writes the buffer; the step's rows are read
after it, when the next step is prepared or a client asks. Here a stand-in router is captured in a
graph, replayed for two steps with other ids each, and the recorder files each step's rows under
its tokens, as on CPU (``tests/unit/test_routing_recorder.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gpu_helpers import record

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LAYERS, TOP_K, TOKENS = 3, 2, 8


@pytest.mark.gpu
def test_capture_inside_a_cuda_graph_writes_the_buffer_each_replay_and_rows_are_filed():
    from megathunder.rollout.engines.routing_capture import RoutingRecorder

    rec = RoutingRecorder(LAYERS, TOP_K, max_tokens=64, device="cuda")
    logits = torch.zeros(TOKENS, 16, device="cuda")  # the graph's static input: router logits

    def router() -> None:
        for layer in range(LAYERS):
            rec.capture(layer, torch.topk(logits + layer, TOP_K, dim=-1).indices)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        router()  # warm-up outside the graph, as graph capture requires
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        router()

    def expected(ids: torch.Tensor) -> np.ndarray:
        return ids[:, None, :].expand(TOKENS, LAYERS, TOP_K).cpu().numpy()

    prompt = list(range(100, 100 + TOKENS))
    steps = []
    for step, tokens in enumerate((prompt, prompt[:4] + [7, 7, 7, 7])):  # the second a sibling, 4 cached
        start = 0 if step == 0 else 4
        prefix = np.array(tokens[:start]) if rec.needs_prefix(f"r{step}", start) else None
        rec.begin_step([(f"r{step}", start, np.array(tokens[start:]), prefix)])
        ids = torch.stack([torch.randperm(16, device="cuda")[:TOP_K] for _ in range(TOKENS)])
        logits.zero_().scatter_(1, ids, torch.tensor([2.0, 1.0], device="cuda").expand(TOKENS, TOP_K))
        graph.replay()
        steps.append(ids)
    first = rec.lookup(prompt + [1])
    sibling = rec.lookup(prompt[:4] + [7, 7, 7, 7, 1])
    want_first = expected(steps[0])
    want_sibling = np.concatenate([want_first[:4], expected(steps[1])[:4]])
    ok = bool((first == want_first).all() and (sibling == want_sibling).all())
    record("routing_capture_cuda_graph", ok=ok, layers=LAYERS, tokens=TOKENS)
    assert ok, (first, sibling)
