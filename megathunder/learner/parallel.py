"""Parallel layout and process groups, validated first and built once.

``ParallelDims`` checks that the world is exactly tensor x pipeline x context x data *before* any
process group exists. ``init_distributed`` then starts torch.distributed (gloo on CPU, NCCL on GPU), lets
Megatron build its groups once, and returns them as a ``ProcessGroups`` value that is passed to
everything that communicates -- no code of ours reaches into Megatron's globals for a group.

Expert parallelism across data-parallel ranks. Megatron's all-gather token dispatcher gathers every
MoE layer's tokens over the expert grid (its tp_ep group, equal-sized pieces), so the ranks of one
grid must run their micro-batches in lockstep, with equal shapes. The ledger runs each
trajectory's backward passes when its own reward makes them due, with coefficients of that
trajectory alone, so ranks that ran *different* trajectories in one step would hold experts'
gradients mixing trajectories whose coefficients differ -- which no later combination can
separate. So the k = ep x etp / tp DP ranks an expert grid spans form one data-parallel *unit*
(``ProcessGroups.data_unit``): ownership is by unit, every rank of a unit receives the same
trajectories and runs the same passes at the same moment (the same events drive the same ledger on
every rank). Then each rank's dense gradient is its unit's trajectories' gradient (k identical
copies over the unit) and each expert, fed the k identical copies of every token routed to it, holds
k times its share; the DP and expert-DP reductions therefore give k times the batch gradient,
uniformly, and ``MegatronLearner.step`` divides every buffer by k before them (the k copies are
the same computation, bit for bit; their sum over the unit is k times one of them up to the
rounding of the reduction's order, exactly so for one unit of k = 2). The experts are
sharded k times further than EP inside TP allows; the dense compute is repeated k times.
"""

from __future__ import annotations

import math
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
    PrecisionConfig,
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
    ep: int = 1  # expert parallelism (MoE): ep x etp = tp x expert_span
    etp: int = 0  # expert-tensor parallelism (MoE); 0: tp / ep where ep divides tp, else 1
    token_align: int = 1  # each rank's tokens a multiple of this (FP8 GEMMs: ``fp8_token_align``)

    def __post_init__(self) -> None:
        if not self.etp:
            object.__setattr__(self, "etp", self.tp // self.ep if self.tp % self.ep == 0 else 1)

    @property
    def expert_span(self) -> int:
        """Data-parallel ranks one expert grid spans (1: the grid is a tensor-parallel group)."""
        return self.ep * self.etp // self.tp

    @property
    def data_units(self) -> int:
        """Data-parallel units: groups of ``expert_span`` DP ranks that run every trajectory together."""
        return self.dp // self.expert_span

    @classmethod
    def build(cls, cfg: ParallelConfig, world_size: int, token_align: int = 1) -> ParallelDims:
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
        span = cfg.expert_data_span
        if dp % span:
            raise ConfigError(f"learner.parallel.expert_parallel: the expert grid {cfg.expert_parallel} x "
                              f"{cfg.expert_tensor_parallel_size} spans {span} data-parallel ranks, which does not "
                              f"divide the data-parallel size {dp} (world size {world_size})")
        return cls(tp, pp, dp, cp, cfg.sequence_parallel, cfg.cp_comm_type, cfg.expert_parallel,
                   cfg.expert_tensor_parallel_size, token_align)

    @classmethod
    def of(cls, cfg: LearnerConfig, world_size: int) -> ParallelDims:
        """The learner's layout, its token alignment from its precision (``fp8_token_align``)."""
        return cls.build(cfg.parallel, world_size, fp8_token_align(cfg.precision))

    @property
    def seq_multiple(self) -> int:
        """Every trajectory's length is padded to a multiple of this: TP under sequence parallelism
        (the sequence is split over the TP ranks), 2 x CP under context parallelism (Megatron's
        load-balanced chunks), their product with both; and, with ``token_align`` a > 1 (FP8),
        a multiple of a x CP too.

        Why a x CP: a linear layer's GEMM runs over the tokens one rank holds for it. Sequence
        parallelism gathers the whole sequence before every column-parallel linear and
        reduce-scatters after every row-parallel one, so under TP each rank's linear layers see
        all L tokens of a row; under CP each rank holds 2 of 2 CP chunks, L / CP tokens. A
        micro-batch of b rows of padded length L puts b x L / CP tokens into each GEMM: L a
        multiple of a x CP makes that a multiple of a for every b. The lcm keeps the TP / CP
        multiple: both hold at once, and padding is exact whatever the multiple
        (``megathunder.learner.micro_batches``)."""
        base = (self.tp if self.sp else 1) * (2 * self.cp if self.cp > 1 else 1)
        return base if self.token_align <= 1 else math.lcm(base, self.token_align * self.cp)

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
        """The rank in this rank's expert grid (``expert_grid_rank``; the TP rank when the grid is the
        TP group) holding slice ``etp_rank`` of expert-parallel rank ``ep_rank``'s experts: Megatron
        orders the expert grid etp-fastest, then ep (checked in ``init_distributed``)."""
        return etp_rank + self.dims.etp * ep_rank

    @property
    def data_unit(self) -> int:
        """This rank's data-parallel unit (``ParallelDims.data_units``): the trajectories it trains
        are its unit's, which every rank of the unit runs at the same moment."""
        return self.dp_rank // self.dims.expert_span

    @property
    def expert_grid_rank(self) -> int:
        """This rank's place in its expert grid (Megatron's tp_ep group): TP rank, then its DP rank
        within the unit."""
        return self.tp_rank + self.dims.tp * (self.dp_rank % self.dims.expert_span)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1


def fp8_token_align(precision: PrecisionConfig) -> int:
    """The multiple each rank's token count must be under ``precision`` (1 without FP8).

    Transformer Engine's FP8 GEMMs take their operands with the product of all but the last dim
    divisible by 8 and the last divisible by 16 (``transformer_engine.pytorch.utils.
    assert_dim_for_fp8_exec``); the weight-gradient GEMM takes the activations transposed, tokens
    last, so the token count must be a multiple of 16 -- 32 for MXFP8, whose scales cover blocks
    of 32 (Megatron's ``megatron.core.fp8_utils.get_fp8_align_size``, which its MoE layers pad each
    expert's tokens to)."""
    if precision.fp8 is None:
        return 1
    return 32 if precision.fp8_recipe == "mxfp8" else 16


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
    dims = ParallelDims.of(cfg, world_size)
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
    if pgs.expert_tp_rank(pgs.ep_rank, pgs.etp_rank) != pgs.expert_grid_rank:  # the HF import / export relies on it
        raise RuntimeError(f"rank {rank}: expert grid (ep {pgs.ep_rank}, etp {pgs.etp_rank}) is not at grid rank "
                           f"{pgs.expert_grid_rank} (TP rank {pgs.tp_rank}) as expected")
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
