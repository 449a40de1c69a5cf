"""The methods megathunder adds to every vLLM worker (``worker_extension_cls``): load weights sent
inside an RPC, and join / receive from / leave the weight-transfer groups (the receiving end of
``megathunder.weights.wire``).

Imported by the vLLM worker processes, by name (``EXTENSION_CLS`` in ``common.py``).
"""

from __future__ import annotations

import base64
import contextlib
import gc
import json
import math
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
from safetensors.torch import load

from megathunder.rollout.engines import routing_capture as routing
from megathunder.weights.wire import (
    Frame,
    Rendezvous,
    TransferGroup,
    dense_tensors,
    dtype_name,
    read_frames_ahead,
    sparse_patches,
)


class MegathunderWorkerExtension:
    """Methods vLLM mixes into each of its workers (``worker_extension_cls``).

    ``self`` is the vLLM worker; ``self.reload_weights`` is its in-place reloader.
    """

    megathunder_groups: list[TransferGroup] | None  # one per sender, set by megathunder_transfer_join
    megathunder_rdv: Rendezvous | None
    megathunder_shadow: dict[str, torch.Tensor] | None  # sparse patches: the weights in checkpoint layout
    megathunder_routing: routing.RoutingRecorder | None = None  # routing replay: the experts each token went to

    def megathunder_load_safetensors(self, payload_b64: str) -> int:
        """Load the base64 safetensors blob made by ``rpc.encode_tensors``; returns #tensors."""
        tensors = load(base64.b64decode(payload_b64))
        self._megathunder_reload(weights_iterator=iter(tensors.items()))
        return len(tensors)

    def megathunder_load_path(self, weights_path: str) -> None:
        """Reload from a checkpoint directory on this worker's file system."""
        self._megathunder_reload(weights_path=weights_path)

    def _megathunder_reload(self, **source) -> None:
        """vLLM's in-place reload, then the tied output layer re-prepared (``_refresh_tied_head``);
        CPU MoE layers are reloaded through vLLM's first-load path (``_cpu_moe_kernels_reset``)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with _cpu_moe_kernels_reset(model):
            self.reload_weights(**source)  # type: ignore[attr-defined]
        _refresh_tied_head(model)
        if self.megathunder_routing is not None:
            self.megathunder_routing.clear()  # the old weights' routing describes no future sample

    def megathunder_freeze_gc(self) -> None:
        """Move the objects alive now (vLLM, torch, the model: millions, made at start-up) out of
        the garbage collector's reach, as vLLM does in its engine core: collections then walk only
        what later steps make, and the collection in vLLM's worker shutdown takes milliseconds
        instead of seconds."""
        gc.freeze()

    def megathunder_shm_spin_cap(self) -> float | None:
        """How long this worker's shared-memory readers spin at most (``vllm_plugin``; None: vLLM's own)."""
        from megathunder.rollout.engines.vllm_plugin import spin_cap

        return spin_cap()

    def megathunder_cpu_affinity(self) -> str:
        """The cores this worker's model runs on and its torch threads, ``"0-1 x2"`` (``megathunder.cpu_cores``;
        text, which a server's ``/collective_rpc`` passes through unchanged)."""
        from megathunder.cpu_cores import format_list

        return f"{format_list(sorted(os.sched_getaffinity(0)))} x{torch.get_num_threads()}"

    def megathunder_routing_start(self) -> int:
        """Record the experts every MoE layer routes each token to (``routing_capture.py``); returns the
        number of layers recorded."""
        self.megathunder_routing = routing.install(self)
        return self.megathunder_routing.num_layers

    def megathunder_routing_lookup(self, token_ids_json: str) -> dict:
        """The recorded routed experts of the inputs of the JSON list ``token_ids_json`` (strings
        only: a server's ``/collective_rpc`` passes nothing else), encoded by ``routing.encode``."""
        if self.megathunder_routing is None:
            raise RuntimeError("routing lookup before megathunder_routing_start")
        return routing.encode(self.megathunder_routing.lookup(json.loads(token_ids_json)))

    def megathunder_worker_info(self) -> str:
        """This worker's rank among its engine's workers (the groups count them) and its model's
        dtype (what senders cast to), as JSON."""
        dtype = self.vllm_config.model_config.dtype  # type: ignore[attr-defined]
        return json.dumps({"rank": self.rank, "dtype": dtype_name(dtype)})  # type: ignore[attr-defined]

    def megathunder_transfer_join(self, rendezvous_json: str, rank_offset: str) -> int:
        """Join every sender's group as rank ``rank_offset`` + this worker's rank; returns it."""
        rank = int(rank_offset) + self.rank  # type: ignore[attr-defined]
        rdv = Rendezvous.from_json(rendezvous_json)
        device = self.device if rdv.backend == "nccl" else torch.device("cpu")  # type: ignore[attr-defined]
        self.megathunder_groups = [rdv.join(s, rank, device) for s in range(rdv.num_senders)]
        self.megathunder_rdv = rdv
        self.megathunder_shadow = {} if rdv.sparse_threshold > 0 else None
        return rank

    def megathunder_receive_stream(self) -> str:
        """Receive every sender's frames, in sender order, and reload from them; returns JSON:
        tensors reloaded, seconds in all (``total_s``) and seconds blocked on the wire (``wait_s``:
        the rest is vLLM's reload work).

        Without sparse patches, one ``reload_weights`` (the model's ``load_weights`` between vLLM's
        layerwise-reload set-up and finish) consumes the dense tensors as they arrive: vLLM runs a
        layer's post-load processing once all of its tensors have been loaded, and a layer's
        tensors may span frames. With sparse patches, every frame first updates this worker's copy
        (dense tensors replace their entry, patches write their elements), then the whole copy is
        reloaded -- a layer must be reloaded whole, and vLLM's CPU layers keep no plain weight to
        patch in place."""
        groups = getattr(self, "megathunder_groups", None)
        if groups is None:
            raise RuntimeError("this worker is in no weight-transfer group (never joined, or closed)")
        start = time.perf_counter()
        clock = _WaitClock()
        shadow = self.megathunder_shadow
        if shadow is None:
            tensors = _dense_stream(groups, clock)
            count = 0

            def counted() -> Iterator[tuple[str, torch.Tensor]]:
                nonlocal count
                for item in tensors:
                    count += 1
                    yield item

            self._megathunder_reload(weights_iterator=counted())
            for _ in tensors:  # frames the loader left unread: the senders broadcast every one
                pass
        else:
            count = len(_update_shadow(groups, shadow, clock))
            self._megathunder_reload(weights_iterator=iter(shadow.items()))
        return json.dumps({"tensors": count, "total_s": time.perf_counter() - start, "wait_s": clock.seconds})

    def megathunder_transfer_close(self) -> None:
        for group in getattr(self, "megathunder_groups", None) or []:
            group.close()
        self.megathunder_groups = None
        self.megathunder_shadow = None

    def megathunder_fault(self, kind: str) -> str:
        """``chaos.faults`` kill_server / hang_server on a server the run attached to (``server_urls``:
        not its process to signal), sent through the server's authenticated dev endpoint
        (``/collective_rpc``): this worker's server -- the API server process it descends from, and
        every process under it -- gets SIGKILL (``kill``) or SIGSTOP (``hang``), as a launched
        server's process group does. Rank 0 of the server's workers acts (every worker gets the call)."""
        if getattr(self, "rank", 0) != 0:
            return "not rank 0"
        return signal_server(kind)


class _WaitClock:
    """Seconds the loader spent waiting for the next frame (``read_frames_ahead`` receives it while
    the loader works on the last one: this is the wire time the reload did not hide)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def frames(self, groups: list[TransferGroup]) -> Iterator[tuple[Frame, list[torch.Tensor]]]:
        frames = read_frames_ahead(groups)
        while True:
            t0 = time.perf_counter()
            item = next(frames, None)
            self.seconds += time.perf_counter() - t0
            if item is None:
                return
            yield item


@contextlib.contextmanager
def _cpu_moe_kernels_reset(model: torch.nn.Module) -> Iterator[None]:
    """vLLM's CPU experts keep their weights prepacked for their grouped GEMM: on the first load
    ``process_weights_after_loading`` converts the checkpoint layout, builds the MoE kernel and
    prepacks (``CPUUnquantizedExperts.process_weights_after_loading``). On a reload it sees the
    kernel already built, takes the "weight update" branch, which copies the new weights into the
    kernel's storage *unpacked* and never prepacks them: after one push every expert multiplied by
    scrambled weights (a tiny Qwen3-MoE: logprobs off by ~15 after a push, 7.7e-6 before it).
    Dropping the built kernel for the reload makes vLLM take its first-load path, which prepacks;
    a layer the reload did not process gets its kernel back."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    kept: list[tuple[Any, Any]] = []  # (the layer's quant method, its MoE kernel)
    for module in model.modules():
        method: Any = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is not None and isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts):
            kept.append((method, kernel))
            method.moe_kernel = None
    try:
        yield
    finally:
        for method, kernel in kept:
            if method.moe_kernel is None:
                method.moe_kernel = kernel


def _refresh_tied_head(model: torch.nn.Module) -> None:
    """A model with tied embeddings (SmolLM2, Llama 3.2 1B/3B, Qwen2.5 up to 3B) has an output
    layer whose weight *is* the embedding's, and no tensor of its own in the checkpoint. vLLM
    prepares each layer for its kernels after loading (on CPU: a oneDNN-packed copy of the
    weight); a reload updates the shared embedding and re-prepares the embedding layer, but never
    the output layer, which no loaded tensor names -- so it kept multiplying by the first
    embedding: logprobs off by ~1 after one push. Re-run its preparation on the reloaded weight."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or head is embed:
        return
    if not isinstance(getattr(head, "quant_method", None), UnquantizedEmbeddingMethod):
        return  # a quantized head's preparation is not idempotent: not re-run
    if head.weight is not embed.weight and head.weight.data_ptr() != embed.weight.data_ptr():
        return  # untied: reloaded from its own tensor
    head.quant_method.process_weights_after_loading(head)


def _dense_stream(groups: list[TransferGroup], clock: _WaitClock) -> Iterator[tuple[str, torch.Tensor]]:
    for frame, payload in clock.frames(groups):
        if frame.kind != "dense":
            raise RuntimeError("a sparse patch arrived but this worker keeps no copy to patch "
                               "(weight_transfer.sparse_threshold was 0 when the groups were opened)")
        yield from dense_tensors(frame, payload)


def _update_shadow(groups: list[TransferGroup], shadow: dict[str, torch.Tensor], clock: _WaitClock) -> list[str]:
    """Apply every frame of one push to ``shadow``; the names it touched."""
    names = []
    for frame, payload in clock.frames(groups):
        if frame.kind == "dense":
            for name, view in dense_tensors(frame, payload):
                if name in shadow and shadow[name].shape == view.shape and shadow[name].dtype == view.dtype:
                    shadow[name].copy_(view)
                else:
                    shadow[name] = view.clone()
                names.append(name)
            continue
        for slot, indices, values in sparse_patches(frame, payload):
            base = shadow.get(slot.name)
            if base is None or tuple(base.shape) != slot.shape or math.prod(slot.shape) != base.numel():
                raise RuntimeError(f"sparse patch for {slot.name}, which this worker has no dense copy of yet")
            base.view(-1)[indices.to(torch.int64)] = values.to(base.dtype)
            names.append(slot.name)
    return names


API_SERVER = "vllm.entrypoints.openai.api_server"
"""What the command line of a rollout server's API process holds (``megathunder serve`` execs it)."""


def signal_server(kind: str, marker: str = API_SERVER) -> str:
    """SIGKILL (``kill``) or SIGSTOP (``hang``) the closest ancestor of this process whose command
    line holds ``marker`` and every process under it; returns the pids (a killed server never
    answers)."""
    import signal as signals

    import psutil

    if kind not in ("kill", "hang"):
        raise ValueError(f"server fault {kind!r}: kill or hang")
    server = next((p for p in psutil.Process().parents() if marker in " ".join(p.cmdline())), None)
    if server is None:
        raise RuntimeError(f"no ancestor of pid {os.getpid()} runs {marker}")
    me = psutil.Process()
    others = [p for p in server.children(recursive=True) if p.pid != me.pid]
    procs = [*others, server, me]  # this process last: it may not survive its own signal
    sig = signals.SIGKILL if kind == "kill" else signals.SIGSTOP
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    return " ".join(str(p.pid) for p in procs)
