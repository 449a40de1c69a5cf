"""Parallel layout and process groups, validated first and built once.

``ParallelDims`` checks that the world is exactly tensor x pipeline x context x data *before* any
process group exists. ``init_distributed`` then starts torch.distributed (gloo on CPU, NCCL on GPU), lets
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
    check_experts_divide_model,
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
    cp: int = 1
    sp: bool = False  # sequence parallelism over the TP ranks
    cp_comm_type: str = "p2p"
    ep: int = 1  # expert parallelism (MoE), inside the TP group: ep x etp = tp
    etp: int = 0  # expert-tensor parallelism (MoE); 0: tp / ep

    def __post_init__(self) -> None:
        if not self.etp:
            object.__setattr__(self, "etp", self.tp // self.ep)

    @classmethod
    def build(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        tp, pp, cp = cfg.tensor_parallel, cfg.pipeline_parallel, cfg.context_parallel
        if world_size % (tp * pp * cp):
            layout = f"tensor_parallel x pipeline_parallel = {tp} x {pp}" if cp == 1 else \
                f"tensor_parallel x pipeline_parallel x context_parallel = {tp} x {pp} x {cp}"
            raise ConfigError(f"learner.parallel: world size {world_size} is not a multiple of {layout}")
        dp = world_size // (tp * pp * cp)
        if cfg.data_parallel is not None and cfg.data_parallel != dp:
            cp_part = f" x {cp} (cp)" if cp > 1 else ""
            raise ConfigError(
                f"learner.parallel.data_parallel: {cfg.data_parallel}, but world size {world_size} "
                f"= {tp} (tp) x {pp} (pp){cp_part} x {dp} (dp)"
            )
        return cls(tp, pp, dp, cp, cfg.sequence_parallel, cfg.cp_comm_type, cfg.expert_parallel,
                   cfg.expert_tensor_parallel_size)

    @property
    def seq_multiple(self) -> int:
        """Every trajectory's length is padded to a multiple of this: TP under sequence parallelism
        (the sequence is split over the TP ranks), 2 x CP under context parallelism (Megatron's
        load-balanced chunks), their product with both."""
        return (self.tp if self.sp else 1) * (2 * self.cp if self.cp > 1 else 1)

    def check_model(self, model: PolicyModelConfig, experts: bool = True) -> None:
        """``experts=False``: the dense model may be a stand-in (the run's model comes from a
        checkpoint or the tiny model), so the expert layout is checked when the real one is built."""
        try:
            check_parallel_divides_model(model, self.tp, self.pp, self.cp, self.cp_comm_type)
            if experts:
                check_experts_divide_model(model, ParallelConfig(
                    tensor_parallel=self.tp, pipeline_parallel=self.pp, sequence_parallel=self.sp,
                    expert_parallel=self.ep, expert_tensor_parallel=self.etp))
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
    def cp(self) -> dist.ProcessGroup:
        return self.collection.cp

    @property
    def cp_rank(self) -> int:
        return dist.get_rank(self.collection.cp) if self.dims.cp > 1 else 0

    @property
    def ep_rank(self) -> int:
        """This rank's expert-parallel rank: it holds experts [ep_rank * E / ep, (ep_rank + 1) * E / ep)."""
        return dist.get_rank(self.collection.ep) if self.dims.ep > 1 else 0

    @property
    def etp_rank(self) -> int:
        """This rank's expert-tensor-parallel rank (its slice of each of its experts)."""
        return dist.get_rank(self.collection.expt_tp) if self.dims.etp > 1 else 0

    def expert_tp_rank(self, ep_rank: int, etp_rank: int) -> int:
        """The TP rank (in this rank's TP group) holding slice ``etp_rank`` of expert-parallel rank
        ``ep_rank``'s experts: Megatron orders the expert grid etp-fastest, then ep, inside the TP
        group when ep x etp = tp (checked in ``init_distributed``)."""
        return etp_rank + self.dims.etp * ep_rank

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
    if cfg.parallel.context_parallel > 1 and not torch.cuda.is_available():
        raise ConfigError("learner.parallel.context_parallel: needs CUDA GPUs (Transformer Engine's attention)")
    if cfg.precision.layer_spec == "transformer_engine" and not torch.cuda.is_available():
        raise ConfigError("learner.precision.layer_spec: transformer_engine needs CUDA GPUs")
    dims = ParallelDims.build(cfg.parallel, world_size)
    if cfg.model.hf_checkpoint is None:
        dims.check_model(cfg.model, experts=cfg.model.is_moe)

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
        parallel_state.initialize_model_parallel(dims.tp, dims.pp, context_parallel_size=dims.cp,
                                                 expert_model_parallel_size=dims.ep,
                                                 expert_tensor_parallel_size=dims.etp)
    torch.manual_seed(cfg.seed)
    model_parallel_cuda_manual_seed(cfg.seed)
    collection = ProcessGroupCollection.use_mpu_process_groups()
    pgs = ProcessGroups(
        dims=dims,
        rank=rank,
        world_size=world_size,
        tp_rank=dist.get_rank(collection.tp),
        pp_rank=dist.get_rank(collection.pp),
        dp_rank=dist.get_rank(collection.dp),
        collection=collection,
        device=device,
    )
    if pgs.expert_tp_rank(pgs.ep_rank, pgs.etp_rank) != pgs.tp_rank:  # the HF import / export relies on it
        raise RuntimeError(f"rank {rank}: expert grid (ep {pgs.ep_rank}, etp {pgs.etp_rank}) is not at TP rank "
                           f"{pgs.tp_rank} as expected")
    return pgs


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
