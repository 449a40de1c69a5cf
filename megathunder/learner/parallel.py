"""Parallel layout and process groups, validated first and built once.

``ParallelDims`` checks that the world is exactly tensor x pipeline x data *before* any process
group exists. ``init_distributed`` then starts torch.distributed (gloo on CPU, NCCL on GPU), lets
Megatron build its groups once, and returns them as a ``ProcessGroups`` value that is passed to
everything that communicates -- no code of ours reaches into Megatron's globals for a group.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megathunder.config import (
    ConfigError,
    LearnerConfig,
    ParallelConfig,
    PolicyModelConfig,
    check_parallel_divides_model,
)
from megathunder.learner import cpu_compat, rendezvous
from megathunder.learner.rendezvous import rendezvous_from_env

T = TypeVar("T")


@dataclass(frozen=True)
class ParallelDims:
    tp: int
    pp: int
    dp: int

    @classmethod
    def build(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        tp, pp = cfg.tensor_parallel, cfg.pipeline_parallel
        if world_size % (tp * pp):
            raise ConfigError(
                f"learner.parallel: world size {world_size} is not a multiple of "
                f"tensor_parallel x pipeline_parallel = {tp} x {pp}"
            )
        dp = world_size // (tp * pp)
        if cfg.data_parallel is not None and cfg.data_parallel != dp:
            raise ConfigError(
                f"learner.parallel.data_parallel: {cfg.data_parallel}, but world size {world_size} "
                f"= {tp} (tp) x {pp} (pp) x {dp} (dp)"
            )
        return cls(tp, pp, dp)

    def check_model(self, model: PolicyModelConfig) -> None:
        try:
            check_parallel_divides_model(model, self.tp, self.pp)
        except ValueError as err:
            raise ConfigError(f"learner.{err}") from None


@dataclass(frozen=True)
class ProcessGroups:
    dims: ParallelDims
    rank: int
    world_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    collection: Any  # megatron.core.process_groups_config.ProcessGroupCollection
    device: torch.device

    @property
    def tp(self) -> dist.ProcessGroup:
        return self.collection.tp

    @property
    def pp(self) -> dist.ProcessGroup:
        return self.collection.pp

    @property
    def dp(self) -> dist.ProcessGroup:
        return self.collection.dp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's or Slurm's environment; (0, 1, 0) alone."""
    rdzv = rendezvous_from_env()
    return rdzv.rank, rdzv.world_size, rdzv.local_rank


def init_distributed(cfg: LearnerConfig) -> ProcessGroups:
    """Validate the layout, start torch.distributed, build Megatron's groups once."""
    rdzv = rendezvous_from_env()  # fails here, before any config work, if mis-launched
    rank, world_size, local_rank = rdzv.rank, rdzv.world_size, rdzv.local_rank
    dims = ParallelDims.build(cfg.parallel, world_size)
    if cfg.model.hf_checkpoint is None:
        dims.check_model(cfg.model)
    if cfg.precision.layer_spec == "transformer_engine" and not torch.cuda.is_available():
        raise ConfigError("learner.precision.layer_spec: transformer_engine needs CUDA GPUs")

    cpu_compat.enable()
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        alone = world_size == 1 and "MASTER_PORT" not in os.environ
        rendezvous.export(rdzv, backend=backend)
        if world_size > 1:
            print(f"megathunder: {rdzv.describe()}", file=sys.stderr, flush=True)
        if alone:  # an in-process store, so several single-process runs can share a machine
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
    rendezvous.check_world(rdzv, dist.get_rank(), dist.get_world_size())

    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(dims.tp, dims.pp)
    torch.manual_seed(cfg.seed)
    model_parallel_cuda_manual_seed(cfg.seed)
    collection = ProcessGroupCollection.use_mpu_process_groups()
    return ProcessGroups(
        dims=dims,
        rank=rank,
        world_size=world_size,
        tp_rank=dist.get_rank(collection.tp),
        pp_rank=dist.get_rank(collection.pp),
        dp_rank=dist.get_rank(collection.dp),
        collection=collection,
        device=device,
    )


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def from_last_stage(pgs: ProcessGroups, value: T) -> T:
    """A value computed on the last pipeline stage (None elsewhere), on every stage."""
    if pgs.dims.pp == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pgs.pp, pgs.dims.pp - 1), group=pgs.pp)
    return box[0]
