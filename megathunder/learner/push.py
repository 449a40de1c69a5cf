"""The learner's side of a weight push: every pipeline stage sends its own tensors, bucket by bucket.

    join(rendezvous)   once (and again when the engine re-opens its groups): stage s's (TP rank 0,
                       DP rank 0) rank joins transfer group s as its rank 0
                       (``megathunder.weights.wire``); every vLLM worker is in it
    send()             per push, on every learner rank: the stage's parameters one at a time, cast
                       to the workers' dtype on each TP rank, gathered onto TP rank 0
                       (``hf.stage_hf_tensors``), split into HF tensors (views) and packed straight
                       into the frame writer's bucket; a full bucket is broadcast to every worker

Senders go in turn (the workers read group 0, then 1, ...), each stage's ranks doing their own
gathers. Bounds per push: TP rank 0 of a stage holds one gathered parameter and two buckets (the
one it packs while the other is on the wire); its
TP peers a cast copy of one parameter shard; DP replicas nothing. No rank holds its stage, let
alone the model; ``gather_object`` and the rank-0 copy of the model are gone from this path.

**Sparse patches** (``weight_transfer.sparse_threshold`` > 0): every TP rank of DP 0 keeps its
shards as last pushed, in the workers' dtype (``previous``; half an fp32 shard when the workers run
bf16). A parameter's changed elements are those whose bits differ from ``previous`` -- bitwise, so
that a NaN or a signed zero is never taken for unchanged. The changed-mask is gathered with the
values, mapped to HF coordinates by the same views, and a tensor goes as a patch (flat int32
indices + values) when at most ``sparse_threshold`` of it changed, dense otherwise. A worker's copy
patched with exactly the changed elements equals the pushed tensor bit for bit, so the result is
the dense push's; the first push (nothing to compare with) is dense. A push that fails leaves the
engine paused (``update_weights``), so ``previous`` getting ahead of a worker never serves tokens.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megathunder.config import PolicyModelConfig
from megathunder.learner import hf
from megathunder.learner.parallel import ProcessGroups
from megathunder.weights.wire import FrameWriter, PushStats, Rendezvous, TransferGroup

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_VIEW[t.dtype.itemsize])


class StageSender:
    """One learner rank's part in weight pushes over the transfer groups: ``model`` is this rank's
    chunk (``MegatronLearner.model``), its first layer the stage's global layer ``offset``."""

    def __init__(self, model: torch.nn.Module, model_cfg: PolicyModelConfig, pgs: ProcessGroups, offset: int) -> None:
        self.model, self.model_cfg, self.pgs, self.offset = model, model_cfg, pgs, offset
        self.is_sender = pgs.tp_rank == 0 and pgs.dp_rank == 0
        self.rdv: Rendezvous | None = None
        self.group: TransferGroup | None = None
        self.previous: dict[str, torch.Tensor] | None = None  # sparse: shards as last pushed

    def join(self, rendezvous_json: str) -> None:
        """Every learner rank; the stage's sender joins its group (blocks until the workers have)."""
        self.close()
        rdv = self.rdv = Rendezvous.from_json(rendezvous_json)
        pgs = self.pgs
        if rdv.num_senders != pgs.dims.pp:
            raise ValueError(f"the engine opened {rdv.num_senders} sender groups for {pgs.dims.pp} pipeline stages")
        if self.is_sender:
            device = pgs.device if rdv.backend == "nccl" else torch.device("cpu")
            self.group = rdv.join(pgs.pp_rank, 0, device)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.rdv, self.previous = None, None, None

    def send(self) -> dict[str, float]:
        """One push (every learner rank calls it); the whole push's figures, on every rank."""
        if self.rdv is None:
            raise RuntimeError("no weight-transfer group: join() first (the engine opens it at start)")
        pgs, rdv = self.pgs, self.rdv
        dtype = getattr(torch, rdv.dtype)
        writer = FrameWriter(self.group, rdv.bucket_bytes) if self.group is not None else None
        if rdv.sparse_threshold > 0 and pgs.data_unit == 0:  # (an expert grid may span unit 0's DP ranks)
            self._send_sparse(writer, dtype, rdv.sparse_threshold)
        else:
            for name, shape, view in hf.stage_hf_tensors(self.model, self.model_cfg, pgs, self.offset, dtype):
                assert writer is not None
                writer.add(name, shape, view)
        stats = writer.finish() if writer is not None else PushStats()
        return _reduce(stats, pgs.device)

    def _send_sparse(self, writer: FrameWriter | None, dtype: torch.dtype, threshold: float) -> None:
        pgs, m = self.pgs, self.model_cfg
        params = hf.rank_params(self.model, m, pgs, self.offset)
        first = self.previous is None
        previous = self.previous = {} if self.previous is None else self.previous
        for key in hf.megatron_keys(m, pgs.dims.pp, pgs.pp_rank):
            if pgs.dp_rank != 0 and hf.expert_index(key) is None:  # unit 0's other DP ranks: experts only
                continue
            param = params.get(key)  # None: an expert of another expert-parallel rank
            cur = changed = None
            if param is not None:
                cur = param.detach().to(dtype)
                if cur.data_ptr() == param.data_ptr():
                    cur = cur.clone()  # the parameter itself: keep what was pushed, not a live alias
                changed = None if first else (_bits(cur) != _bits(previous[key])).to(torch.uint8)
                previous[key] = cur
            stacked = hf.gather_param(key, cur, m, pgs, dtype)
            mask = None if first else hf.gather_param(key, changed, m, pgs, torch.uint8)
            if writer is None:
                continue
            assert stacked is not None
            views = hf.hf_views(key, stacked, m)
            masks = [None] * len(views) if mask is None else [v for _, _, v in hf.hf_views(key, mask, m)]
            for (name, shape, view), mask_view in zip(views, masks, strict=True):
                if mask_view is None:
                    writer.add(name, shape, view)
                    continue
                idx = torch.nonzero(mask_view.reshape(-1)).reshape(-1).to(torch.int32)
                if idx.numel() > threshold * math.prod(shape):
                    writer.add(name, shape, view, changed=int(idx.numel()))
                elif idx.numel():
                    writer.add_sparse(name, shape, idx, view.reshape(-1)[idx])
                else:
                    writer.skip(name, shape, view.dtype)


def _reduce(stats: PushStats, device: torch.device) -> dict[str, float]:
    """Every sender's figures summed over the learner's ranks (non-senders add zeros)."""
    values = torch.tensor(list(stats.__dict__.values()), dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
    out = dict(zip(stats.__dict__, (float(v) for v in values.cpu()), strict=True))
    out["changed_fraction"] = out["changed_elements"] / max(out["num_elements"], 1.0)
    return out


def gather_to_rank0(model: torch.nn.Module, m: PolicyModelConfig, pgs: ProcessGroups,
                    offset: int) -> list[tuple[str, torch.Tensor]] | None:
    """The rpc fallback (``weight_transfer.kind=rpc``): every HF tensor on global rank 0 (None
    elsewhere), stage 0's from rank 0's own gathers, stage s's received tensor by tensor from the
    stage's (TP 0, DP 0) rank by point-to-point sends (shapes known from the config; no pickled
    objects). Rank 0 then holds the whole model: that is what the rpc payload needs, and why
    ``collective`` is the default."""
    out: list[tuple[str, torch.Tensor]] = []
    sends = hf.stage_hf_tensors(model, m, pgs, offset)
    if pgs.rank == 0:
        out = [(name, view.reshape(shape).cpu().clone()) for name, shape, view in sends]
    else:
        for name, shape, view in sends:  # this stage's TP rank 0 (yielded only there)
            dist.send(view.reshape(shape).contiguous(), dst=0)
    if pgs.rank != 0:
        return None
    dtype = next(model.parameters()).dtype
    for stage in range(1, pgs.dims.pp):
        src = _stage_sender_rank(pgs, stage)
        for name, shape in hf.hf_stage_layout(m, pgs.dims.pp, stage):
            t = torch.empty(shape, dtype=dtype, device=pgs.device)
            dist.recv(t, src=src)
            out.append((name, t.cpu()))
    return out


def _stage_sender_rank(pgs: ProcessGroups, stage: int) -> int:
    """Global rank of stage ``stage``'s (TP 0, DP 0) rank: rank 0's pipeline group member."""
    return dist.get_global_rank(pgs.pp, stage)
