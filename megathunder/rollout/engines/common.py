"""What both deployments share: vLLM engine arguments and reading vLLM's outputs."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from megathunder import cpu_cores
from megathunder.config import EngineConfig
from megathunder.rollout.types import FinishReason

EXTENSION_CLS = "megathunder.rollout.engines.worker_extension.MegathunderWorkerExtension"
"""Passed to vLLM as ``worker_extension_cls`` (``--worker-extension-cls`` for servers)."""


def single_version(spans, num_tokens: int, request_id: str) -> int:
    """The one policy version in a completion's weight-version spans (objects or JSON dicts).

    Several versions would mean weights changed mid-request, which update_weights rules out;
    a completion without tokens (aborted before its first) has none: -1.
    """
    versions = {span.version if hasattr(span, "version") else span["version"] for span in spans or ()}
    if len(versions) > 1:
        raise RuntimeError(f"request {request_id} was sampled by several weight versions {versions}")
    if not versions:
        if num_tokens:
            raise RuntimeError(f"request {request_id}: vLLM returned no weight version")
        return -1
    return int(versions.pop())


def finish_reason(reason: str | None) -> FinishReason:
    if reason == "stop":
        return "stop"
    if reason == "length":
        return "length"
    return "abort"


def engine_kwargs(cfg: EngineConfig) -> dict:
    """EngineConfig -> vLLM engine arguments (shared by the in-process and server launchers)."""
    kwargs = dict(
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        enforce_eager=cfg.enforce_eager,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        enable_prefix_caching=cfg.enable_prefix_caching,
        logprobs_mode=cfg.logprobs_mode,
        seed=cfg.seed,
        worker_extension_cls=EXTENSION_CLS,
    )
    if cfg.block_size is not None:
        kwargs["block_size"] = cfg.block_size
    if cfg.scheduling != "fifo":  # requests carry priorities (megathunder.rollout.priority)
        kwargs["scheduling_policy"] = "priority"
    if cfg.record_routing:  # the recorder attributes rows by the tokens of a synchronous runner (routing_capture)
        kwargs["async_scheduling"] = False
    chunked = cfg.enable_chunked_prefill
    if chunked is None and _on_cpu():
        chunked = False
    if chunked is not None:
        kwargs["enable_chunked_prefill"] = chunked
        if not chunked:  # every prompt must then fit one step
            kwargs["max_num_batched_tokens"] = max(cfg.max_model_len, 8192)
    kwargs.update(cfg.vllm_kwargs)
    return kwargs


def engine_environment(cfg: EngineConfig, server: int = 0) -> dict[str, str]:
    """What one engine's processes read from the environment as they start: vLLM's batch-invariant
    kernels (``rollout.engine.batch_invariant``) and the OpenMP binding of its CPU workers."""
    env = cpu_environment(cfg, server)
    if cfg.batch_invariant:
        env["VLLM_BATCH_INVARIANT"] = "1"
    return env


def cpu_environment(cfg: EngineConfig, server: int = 0) -> dict[str, str]:
    """The OpenMP binding of one engine's CPU workers (``rollout.engine.cpu_cores``; launched servers
    split the cores in order, one share each, and each engine one share per worker); nothing
    without cores, leaving vLLM's own binding."""
    if cfg.cpu_cores is None:
        return {}
    engines = cfg.num_servers if cfg.deployment == "server" else 1
    workers = int(cfg.vllm_kwargs.get("tensor_parallel_size", 1)) * int(cfg.vllm_kwargs.get("pipeline_parallel_size", 1))
    return cpu_cores.engine_environment(cpu_cores.share(cfg.cpu_cores, server, engines), workers)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def scored_prompt(prompt_token_ids: Sequence[int], start: int, entries: Sequence[Mapping[Any, Any] | None] | None,
                  logprob_of: Callable[[Any], float], keys: Callable[[int], Any] = int) -> list[float]:
    """``Completion.prompt_logprobs`` (``SamplingParams.prompt_logprobs_from`` = ``start``) from
    vLLM's per-position entries (None at position 0; each maps ``keys(token id)`` -> its logprob,
    read by ``logprob_of``)."""
    if not 1 <= start <= len(prompt_token_ids) or entries is None or len(entries) != len(prompt_token_ids):
        raise RuntimeError(f"prompt logprobs from {start} of a {len(prompt_token_ids)}-token prompt: the engine "
                           f"returned {None if entries is None else len(entries)} entries")
    out = []
    for entry, token in zip(entries[start:], prompt_token_ids[start:], strict=True):
        if entry is None:
            raise RuntimeError(f"no prompt logprob for token {token}: a cached prefix was read")
        out.append(float(logprob_of(entry[keys(token)])))
    return out
