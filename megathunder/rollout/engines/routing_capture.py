"""The experts vLLM routed each token to, recorded inside the engine for routing replay.

Routing replay (``rollout.engine.routing_replay``) makes the learner's MoE layers use, for every
position of a trajectory, the experts the rollout engine's routers picked when it computed that
position -- so the learner's gradient is the gradient of the policy that produced the sample,
whatever rounding differences between the two stacks do to near-tied router logits.

vLLM 0.32 can return the routed experts itself (``enable_return_routed_experts``), but only under
its V2 model runner, which needs a GPU build of Triton: on CPU it refuses at start. This recorder
does the same job on any runner, with vLLM's own capture hooks on the routers
(``bind_routed_experts_capturer``: every MoE layer writes its top-k ids for the step's tokens) and
a wrapper around the runner's ``_prepare_inputs`` that says which request and position each row of
the step is (the runner lays a step's tokens out request by request, each request's new positions
in order from its computed-token count).

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
computed (the engine's view of the tokens differed from the trajectory's) are -1.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import numpy as np
import torch

MISSING = -1
"""An expert id for a position whose routing the engine never computed."""


class RoutingRecorder:
    """One per vLLM worker: the capture hooks' step buffer and the prefix trie of routed experts."""

    def __init__(self, num_layers: int, top_k: int, max_tokens: int) -> None:
        self.num_layers, self.top_k = num_layers, top_k
        self._step = torch.full((max_tokens, num_layers, top_k), MISSING, dtype=torch.int16)
        self._pending: list[tuple[str, int, np.ndarray, np.ndarray | None]] = []
        self.clear()

    def clear(self) -> None:
        """Forget every recorded row (the weights changed)."""
        self._children: dict[tuple[int, int], int] = {}
        self._rows = np.full((1024, self.num_layers, self.top_k), MISSING, dtype=np.int16)
        self._num_nodes = 1  # node 0: the empty prefix
        self._frontier: dict[str, tuple[int, int]] = {}  # request -> (positions walked, node)
        self._pending = []

    # -- inside the engine's step ------------------------------------------------------------
    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """vLLM's capture hook: layer ``layer_id``'s top-k expert ids for the step's rows."""
        self._step[: topk_ids.shape[0], layer_id] = topk_ids.to(torch.int16)

    def begin_step(self, steps: Sequence[tuple[str, int, np.ndarray, np.ndarray | None]]) -> None:
        """A step is about to run: per request, (id, first position computed, the tokens it
        computes, and -- only when ``needs_prefix`` -- the tokens before them)."""
        self._pending = list(steps)

    def needs_prefix(self, request: str, start: int) -> bool:
        """Whether a request's next positions do not continue where the trie left it (a cached
        prefix, a new request, a recompute after preemption): then its prefix is walked."""
        self.flush()
        return start > 0 and self._frontier.get(request, (0, 0))[0] != start

    def flush(self) -> None:
        """File the last step's rows under their prefixes (its forward has run by now: the runner
        is synchronous on CPU, and a client asks only after the request's output came back)."""
        row = 0
        step = self._step.numpy()
        for request, start, new_tokens, prefix in self._pending:
            node = self._frontier.get(request, (0, 0))[1] if prefix is None else self._walk(prefix)
            if start == 0:
                node = 0
            for token in new_tokens:
                node = self._child(node, int(token))
                self._rows[node] = step[row]
                row += 1
            self._frontier[request] = (start + len(new_tokens), node)
        self._pending = []

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
    """Bind a recorder to a vLLM worker's model (the routers' capture hooks) and runner."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        _get_routed_experts_shape,
        bind_routed_experts_capturer,
    )

    runner = worker.model_runner
    num_layers, _num_experts, top_k = _get_routed_experts_shape(worker.vllm_config)
    max_tokens = worker.vllm_config.scheduler_config.max_num_batched_tokens
    recorder = RoutingRecorder(num_layers, top_k, max_tokens)
    bind_routed_experts_capturer(runner.get_model(), recorder)
    prepare = runner._prepare_inputs

    def prepare_inputs(scheduler_output, num_scheduled_tokens: np.ndarray):
        batch = runner.input_batch
        steps = []
        for i, request in enumerate(batch.req_ids[: batch.num_reqs]):
            start = int(batch.num_computed_tokens_cpu[i])
            end = start + int(num_scheduled_tokens[i])
            prefix = batch.token_ids_cpu[i, :start].copy() if recorder.needs_prefix(request, start) else None
            steps.append((request, start, batch.token_ids_cpu[i, start:end].copy(), prefix))
        recorder.begin_step(steps)
        return prepare(scheduler_output, num_scheduled_tokens)

    runner._prepare_inputs = prepare_inputs
    return recorder
