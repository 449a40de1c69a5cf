"""The experts vLLM routed each token to, recorded inside the engine for routing replay.

Routing replay (``rollout.engine.routing_replay``) makes the learner's MoE layers use, for every
position of a trajectory, the experts the rollout engine's routers picked when it computed that
position -- so the learner's gradient is the gradient of the policy that produced the sample,
whatever rounding differences between the two stacks do to near-tied router logits.

vLLM 0.32 can return the routed experts itself (``enable_return_routed_experts``: its
``RoutedExpertsCapturer`` and auxiliary-output connector), but only under its V2 model runner,
which needs a GPU build of Triton: on CPU it refuses at start, and using it would change what the
engines return with every completion. This recorder does the same job on any runner, CPU and GPU
alike, with vLLM's own capture hooks on the routers (``bind_routed_experts_capturer``: every MoE
layer hands its top-k ids for the step's tokens to ``capture``) and a wrapper around the runner's
``_prepare_inputs`` that says which request and position each row of the step is (the runner lays
a step's tokens out request by request, each request's new positions in order from its
computed-token count).

Inside the forward: a device buffer. ``capture`` copies each layer's ids into a buffer allocated
once on the model's device, ``[max_num_batched_tokens, layers, top_k]`` -- a device-to-device copy
at a fixed address, as vLLM's own capturer does: nothing is allocated, nothing waits for the host,
so it is legal inside a CUDA-graph capture and a compiled forward. The hooks are bound when the
model is loaded (``megathunder.rollout.engines.vllm_plugin``), before vLLM captures its graphs or
compiles, so the captured graphs write the buffer too; rows past a step's tokens (a graph's padding)
are never read.

After the step: read on the host. When the runner prepares the next step -- before that step's
forward can overwrite the buffer -- the last step's rows are copied to the host (ordered on the
stream after the forward that wrote them; a synchronous runner has waited for that forward's
sampled tokens already, so the copy waits for nothing more) and filed under their prefixes; a
lookup files the last step the same way. Attribution needs each row's token ids when the step is
prepared, which a synchronous runner has (the sampled tokens are back in its batch before the next
step is prepared); under vLLM's async scheduling the runner prepares a step before the last one's
tokens reach the host (placeholders of -1 stand in for them), so recording needs synchronous
scheduling: ``common.engine_kwargs`` turns async scheduling off when ``record_routing`` is set,
and ``install_on_runner`` refuses a runner that has it on.

Rows are kept in a trie of token prefixes: the routing of position p is stored at the node of the
tokens [0..p] (a position's routing depends on exactly those tokens under the current weights).
A later request that reuses a cached prefix (a group's siblings sharing a prompt, the next turn of
an agentic episode) finds those rows where the computation that filled its KV cache left them, so
the routing returned is the routing behind every position's hidden states, cached or not. The
trie is exact (no hashing collisions: children are keyed by (parent node, token)). It is cleared
whenever the weights change -- the routing of the old weights describes no future sample -- and
the prefix cache is reset at the same moment (``update_weights``).

A trajectory's last token is never an input (the sampler produced it and the request ended), and
the learner never feeds it either (its inputs are tokens[:-1]), so the rows returned cover exactly
the learner's inputs: ``[len(tokens) - 1, num_layers, top_k]``. Positions the recorder never saw
computed are -1: the engine's view of the tokens differed from the trajectory's, or tokens were
appended that no request computed (the agent loop appends no tool response after the last turn
for this reason: ``megathunder.rollout.agent_loop``).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

MISSING = -1
"""An expert id for a position whose routing the engine never computed."""

StepPlan = tuple[str, int, np.ndarray, "np.ndarray | None"]
"""(request id, first position computed, the tokens it computes, the tokens before them -- only
where ``needs_prefix`` said so)."""


@dataclass
class _Step:
    """One prepared step: its requests' layout and how many rows of the buffer it writes."""

    plan: list[StepPlan]
    num_rows: int


class RoutingRecorder:
    """One per vLLM worker: the capture buffer on the model's device, the step whose forward runs,
    and the prefix trie of routed experts."""

    def __init__(self, num_layers: int, top_k: int, max_tokens: int, device: torch.device | str = "cpu") -> None:
        self.num_layers, self.top_k = num_layers, top_k
        self.device_rows = torch.full((max_tokens, num_layers, top_k), MISSING, dtype=torch.int16, device=device)
        """Written by ``capture`` inside the forward; allocated once (CUDA graphs keep its address)."""
        self.clear()

    def clear(self) -> None:
        """Forget every recorded row and the step not filed yet (the weights changed)."""
        self._children: dict[tuple[int, int], int] = {}
        self._rows = np.full((1024, self.num_layers, self.top_k), MISSING, dtype=np.int16)
        self._num_nodes = 1  # node 0: the empty prefix
        self._scheduled: dict[str, int] = {}  # request -> positions it has computed or has scheduled
        self._nodes: dict[str, int] = {}  # request -> its trie node after its last filed step
        self._running: _Step | None = None  # prepared; its forward is running or has run

    # -- inside the engine's step ------------------------------------------------------------
    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """vLLM's capture hook: layer ``layer_id``'s top-k expert ids for the step's rows, copied
        into the device buffer (no allocation, no host synchronisation)."""
        self.device_rows[: topk_ids.shape[0], layer_id].copy_(topk_ids)

    def begin_step(self, steps: Sequence[StepPlan]) -> None:
        """A step is about to run (its forward not enqueued yet): file the last step's rows, then
        take this step's layout."""
        self.flush()
        plan = list(steps)
        for request, start, new_tokens, _ in plan:
            self._scheduled[request] = start + len(new_tokens)
        self._running = _Step(plan, sum(len(tokens) for _, _, tokens, _ in plan))

    def needs_prefix(self, request: str, start: int) -> bool:
        """Whether a request's next positions do not continue where its last step left it (a cached
        prefix, a new request, a recompute after preemption): then its prefix tokens are kept, to
        be walked when the step is filed."""
        return start > 0 and self._scheduled.get(request, 0) != start

    def flush(self) -> None:
        """File the running step's rows under their prefixes: read off the buffer after its forward
        (a step is prepared, or a client asks, only once the last forward's output is back)."""
        step, self._running = self._running, None
        if step is None or not step.num_rows:
            return
        rows, row = self.device_rows[: step.num_rows].cpu().numpy(), 0
        for request, start, new_tokens, prefix in step.plan:
            node = self._nodes.get(request, 0) if prefix is None else self._walk(prefix)
            if start == 0:
                node = 0
            for token in new_tokens:
                node = self._child(node, int(token))
                self._rows[node] = rows[row]
                row += 1
            self._nodes[request] = node

    # -- asked by the client -----------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int]) -> np.ndarray:
        """The routed experts of the inputs of ``token_ids``: [len - 1, num_layers, top_k] int16."""
        self.flush()
        out = np.full((max(len(token_ids) - 1, 0), self.num_layers, self.top_k), MISSING, dtype=np.int16)
        node = 0
        for p, token in enumerate(token_ids[:-1]):
            node = self._children.get((node, int(token)), -1)
            if node < 0:
                break
            out[p] = self._rows[node]
        return out

    # -- the trie ----------------------------------------------------------------------------
    def _child(self, node: int, token: int) -> int:
        key = (node, token)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._num_nodes
            self._num_nodes += 1
            if child == len(self._rows):
                grown = np.full((2 * len(self._rows), self.num_layers, self.top_k), MISSING, dtype=np.int16)
                grown[: len(self._rows)] = self._rows
                self._rows = grown
        return child

    def _walk(self, tokens: np.ndarray) -> int:
        node = 0
        for token in tokens:
            node = self._child(node, int(token))  # a prefix never computed keeps MISSING rows
        return node


def encode(rows: np.ndarray) -> dict:
    """Rows as JSON (what a server's ``/collective_rpc`` can return): shape and base64 int16."""
    return {"shape": list(rows.shape), "rows": base64.b64encode(rows.astype(np.int16).tobytes()).decode()}


def decode(result: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(result["rows"]), dtype=np.int16).reshape(result["shape"]).copy()


def install(worker) -> RoutingRecorder:
    """The recorder of a vLLM worker's runner: the one bound when its model was loaded
    (``vllm_plugin``), else bound now (a runner without CUDA graphs or compilation: eager CPU)."""
    return install_on_runner(worker.model_runner)


def install_on_runner(runner) -> RoutingRecorder:
    """Bind a recorder to a model runner's routers (vLLM's capture hooks) and its ``_prepare_inputs``;
    once per runner (a second call returns the first recorder)."""
    recorder: RoutingRecorder | None = getattr(runner, "megathunder_recorder", None)
    if recorder is not None:
        return recorder
    config = runner.vllm_config
    if config.scheduler_config.async_scheduling:
        raise RuntimeError("routing capture needs synchronous scheduling (async scheduling prepares a step before "
                           "the last one's sampled tokens reach the host); megathunder turns it off with "
                           "record_routing: do not set async_scheduling in rollout.engine.vllm_kwargs")
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        _get_routed_experts_shape,
        bind_routed_experts_capturer,
    )

    num_layers, _num_experts, top_k = _get_routed_experts_shape(config)
    max_tokens = config.scheduler_config.max_num_batched_tokens
    model = runner.get_model()
    device = next(model.parameters()).device
    recorder = RoutingRecorder(num_layers, top_k, max_tokens, device)
    bind_routed_experts_capturer(model, recorder)
    prepare = runner._prepare_inputs

    def prepare_inputs(scheduler_output, num_scheduled_tokens: np.ndarray, *args, **kwargs):
        batch = runner.input_batch
        steps: list[StepPlan] = []
        for i, request in enumerate(batch.req_ids[: batch.num_reqs]):
            start = int(batch.num_computed_tokens_cpu[i])
            end = start + int(num_scheduled_tokens[i])
            prefix = batch.token_ids_cpu[i, :start].copy() if recorder.needs_prefix(request, start) else None
            steps.append((request, start, batch.token_ids_cpu[i, start:end].copy(), prefix))
        recorder.begin_step(steps)
        return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

    runner._prepare_inputs = prepare_inputs
    runner.megathunder_recorder = recorder
    return recorder
