"""The gradient ledger's backend on Megatron: trajectories are the micro-batches of Megatron's own
forward-backward schedule (pipeline parallel included), accumulating into DDP's gradient buffers.

The "live" gradient storage the ledger reads is ``DistributedDataParallel.buffers[*].grad_data``
-- the flat buffers every parameter's ``main_grad`` is a view of. A backward for the ledger runs
inside ``no_sync`` (no data-parallel communication per trajectory), after ``zero_grad_buffer``;
the ledger copies or adds the result into its own accumulators. At batch close the final
gradient is written back into ``grad_data`` and reduced across data-parallel ranks once.

All ranks of one model-parallel group (TP and PP peers) must call ``backward`` with the same
trajectories in the same order: the schedule communicates between them.

Long trajectories (``run_schedule``). Under sequence parallelism the sequence is split over the TP
ranks and under context parallelism over the CP ranks (Megatron's load-balanced layout: 2 x CP
chunks, rank r holding chunks r and 2CP - 1 - r), so each trajectory's inputs are padded at the end
to a multiple of ``ParallelDims.seq_multiple``. Padding is exact: attention is causal, so no real
position sees a pad, and the pads' targets are cut off before the loss, so their rows carry zero
gradient. Under CP each rank's logits cover its own chunks; their token logprobs (and entropies)
are gathered into the whole sequence with a gather whose backward returns each rank its own
positions' share, so ``loss_fn`` still sees one whole trajectory -- per-sequence terms (the
aggregation's nu_i, sequence-level TIS) stay what they are -- and every CP rank computes the same
loss; each rank's backward then covers the paths through its own chunks, and the DP x CP gradient
reduction in ``step`` sums them into the trajectory's gradient.

Packing (``learner.pack_tokens``). A schedule call over many short trajectories would pay one
micro-batch's fixed cost (a forward and a backward's launches, a pipeline hand-off) per trajectory
-- on the quickstart that overhead, not the arithmetic, set the step time. So ``run_schedule``
groups the trajectories, longest first, into micro-batches of at most ``pack_tokens`` tokens,
counted as rows x longest padded length (``megathunder.trajectory.pack_micro_batches``: rows of
nearly equal length, so little is padded; a trajectory longer than the cap is a micro-batch
alone), each one [rows, T_max] forward, right-padded. It is exact for the same reasons padding
is, one row at a time: nothing in the model mixes the rows of a batch (attention is per row and
causal, norms, RoPE and matmuls act per position), every row starts at position 0, and each row's
pads come after its real positions, their targets cut off before the loss. The micro-batch's loss is the sum of its rows' losses, each ``loss_fn(k, ...)``
given one whole trajectory's logprobs, so per-sequence terms stay exact and the gradient is the
sum of the trajectories' gradients -- reassociated (a weight gradient's GEMM sums a micro-batch's
tokens at once), so equal up to fp32 rounding, not bitwise. Under PP the micro-batches' shapes
vary in both the sequence and the batch dimension; Megatron's ``variable_seq_lengths`` sends each
hand-off's full shape first, so no row padding is needed. Under SP the padded length is a
multiple of TP as before (the batch dimension is not split). Under CP the sequence gather is per
trajectory, so CP falls back to one trajectory per micro-batch.

Logits at the loss's targets only (``learner.loss_logits_only``, training passes). The output
layer's input, [T_max, b, h] on the last stage, is cut to the rows at the micro-batch's loss-mask
targets, [n, 1, h], by a pre-hook on the layer for the duration of one forward (``_LossRows``);
``_loss_func`` computes their logprobs and puts each trajectory's back at its positions, zeros
elsewhere, with no path to the graph there. Exact: every loss reads its terms through its effective
mask, a subset of the loss mask, with ``torch.where``, so what sits at the other positions never
reaches a loss or a gradient; and the rows the head sees are the same hidden states. Under sequence
parallelism the layer's input is a sequence shard: the hook gathers it first and runs the layer
without its SP gather for that call, so each rank's input gradient is still the TP sum of its own
positions (``_LossRows``).

Shared prefixes (``learner.share_prefixes``). A group's trajectories share one row, their common
prefix (the prompt) forwarded once, each suffix at its own positions under a prefix + own-suffix
attention mask; the head reads each trajectory's targets through ``_LossRows``
(``megathunder.learner.shared_prefix`` derives why it is exact).

Router losses (``learner.moe.aux_loss_coeff`` / ``z_loss_coeff``). Each micro-batch's rows get
their trajectories' router-loss weights just before its forward (``router_weights``: the pass's
weight of each trajectory, 0 in a score-only pass; ``megathunder.learner.router_losses`` derives
why the streamed sum is the batch's).

Routing replay (``learner.moe.routing_replay``). When the model replays and the trajectories carry
the engine's routed experts, each micro-batch's rows are handed to the routers just before its
forward (``megathunder.learner.routing_replay``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.utils import get_attr_wrapped_model

from megathunder.config import RLObjective
from megathunder.learner.logprobs import vocab_parallel_logprobs
from megathunder.learner.parallel import ProcessGroups
from megathunder.learner.router_losses import schedule_router_losses
from megathunder.learner.routing_replay import schedule_replay
from megathunder.learner.shared_prefix import MAX_ROW, SharedRow, micro_batch, rotary_positions, shared_rows
from megathunder.objectives import LossSpec, router_loss_weight, trajectories_loss
from megathunder.streaming.buffers import GradBuffer
from megathunder.trajectory import Trajectory, loss_targets, pack_micro_batches


def run_schedule(
    ddp_model: torch.nn.Module,
    pgs: ProcessGroups,
    items: Sequence[Trajectory],
    loss_fn: Callable[[Sequence[int], torch.Tensor, torch.Tensor | None], torch.Tensor],
    *,
    need_entropy: bool,
    forward_only: bool = False,
    temperature: float = 1.0,
    pack_tokens: int = 0,
    router_weights: Sequence[float] | None = None,
    loss_logits_only: bool = False,
    share_prefixes: bool = False,
) -> list[dict]:
    """One Megatron forward(-backward) schedule call over ``items``, several trajectories packed
    into each micro-batch.

    The trajectories are grouped, longest first, into micro-batches of at most ``pack_tokens``
    tokens (rows x padded length, ``pack_micro_batches``; 0: one trajectory per micro-batch). A
    micro-batch is one [b, T_max] forward, right-padded; its loss is the sum of its
    trajectories' losses. ``loss_fn(ks, logp_N, entropy_N)`` gives that sum on the last stage for
    the micro-batch's trajectories ``ks`` (indices into ``items``) from their logprobs (and
    entropies) of softmax(logits / ``temperature``) at their loss-mask targets, concatenated in
    order (``objectives.trajectories_loss``: one flat computation, each trajectory's own
    per-sequence terms). Under context parallelism every micro-batch holds one
    trajectory (the CP gather is per sequence; ``pack_tokens`` is ignored). Returns, on the last
    stage, one dict per trajectory (in ``items`` order) with its detached ``logp`` (and
    ``entropy``); nothing on other stages. ``router_weights``: each trajectory's weight of a
    MoE model's router losses in this call (``megathunder.learner.router_losses``; None: a call
    that trains none, e.g. forward-only). ``loss_logits_only``: the output layer only at each
    trajectory's loss-mask targets (``learner.loss_logits_only``); the reports then hold zeros at
    every other target. Not under context parallelism. ``share_prefixes``: in a training pass
    with ``loss_logits_only`` or a forward-only one (and no router losses or routing replay), the
    trajectories of one group share a row, their common prefix forwarded once
    (``megathunder.learner.shared_prefix``; the model must be ``shared_prefix.supported``); a
    forward-only call then reads the output layer at every target through the same row gather.
    """
    device = pgs.device
    dims = pgs.dims
    lengths = [padded_length(t.tokens.numel() - 1, dims.seq_multiple) for t in items]
    replay = schedule_replay(ddp_model, items, pgs)  # learner.moe.routing_replay
    router_losses = schedule_router_losses(ddp_model, [t.tokens.numel() - 1 for t in items], router_weights, pgs)
    at_targets_only = loss_logits_only and dims.cp == 1
    head = _LossRows.of(ddp_model, pgs) if at_targets_only else None  # None off the last stage
    counts, at = loss_targets(items)  # each trajectory's loss targets
    shared: list[tuple[list[SharedRow], int]] = []  # learner.share_prefixes: each micro-batch's rows, width
    loss_at = at
    if (share_prefixes and (at_targets_only or forward_only) and dims.cp == 1 and pack_tokens > 0
            and replay is None and router_losses is None):
        rows = shared_rows(items, min(pack_tokens, MAX_ROW))
        if any(len(row.members) > 1 for row in rows):  # else one trajectory a row: the plain layout
            widths = [padded_length(row.width, dims.seq_multiple) for row in rows]
            for mb in pack_micro_batches(widths, pack_tokens):
                shared.append(([rows[r] for r in mb], max(widths[r] for r in mb)))
            lengths = widths
            if not at_targets_only:  # forward-only scoring: the head at every target, through the same gather
                head = _LossRows.of(ddp_model, pgs)
                counts = [t.tokens.numel() - 1 for t in items]
                at = [torch.arange(n) for n in counts]
    if shared:
        groups = [[k for row in mb for k in row.members] for mb, _ in shared]
    else:
        groups = pack_micro_batches(lengths, pack_tokens if dims.cp == 1 else 0)
    index = iter(range(len(groups)))

    def forward_step(data_iterator, model):
        i = next(data_iterator)
        if shared:  # the group's common prefix once per row (megathunder.learner.shared_prefix)
            mb_rows, width = shared[i]
            mb = micro_batch(items, mb_rows, width, counts, at, device)
            select = head.select(mb.head_rows, mb.head_cols, len(mb_rows)) if head else contextlib.nullcontext()
            with select, rotary_positions(model, mb.positions):
                output = model(mb.inputs, mb.positions, attention_mask=mb.mask)
            if at_targets_only:
                return output, partial(_loss_func, mb.ks, mb.labels, mb.rows, mb.cols, True)
            # scoring every target: loss_fn still gets the loss targets' values, picked from them
            n = torch.tensor([counts[k] for k in mb.ks])
            first = torch.cumsum(n, 0) - n  # each trajectory's first target among the micro-batch's
            picks = torch.cat([loss_at[k] + first[j] for j, k in enumerate(mb.ks)]).to(device)
            return output, partial(_loss_func, mb.ks, mb.labels, mb.rows, mb.cols, True, picks=picks)
        ks = groups[i]
        width = max(lengths[k] for k in ks)
        if replay is not None:
            replay.set(ks, width)
        if router_losses is not None:
            router_losses.set(ks, width)
        inputs, labels = _inputs_and_labels([items[k].tokens for k in ks], width, device)
        positions = torch.arange(width, device=device)[None].expand(len(ks), width)
        if dims.cp > 1:  # one trajectory per micro-batch (above)
            from megatron.core.utils import get_batch_on_this_cp_rank

            local = get_batch_on_this_cp_rank({"tokens": inputs, "labels": labels, "position_ids": positions}, pgs.cp)
            inputs, labels, positions = local["tokens"], local["labels"], local["position_ids"]
        # (row, position) of every loss target of the micro-batch, trajectory after trajectory
        cols = torch.cat([at[k] for k in ks]).to(device)
        rows = torch.repeat_interleave(torch.arange(len(ks)), torch.tensor([counts[k] for k in ks])).to(device)
        if not at_targets_only:
            return model(inputs, positions, attention_mask=None), partial(_loss_func, ks, labels, rows, cols, False)
        with head.select(rows, cols, len(ks)) if head else contextlib.nullcontext():
            output = model(inputs, positions, attention_mask=None)
        return output, partial(_loss_func, ks, labels[rows, cols], rows, cols, True)

    def _loss_func(ks, labels, rows, cols, at_targets_only, output, picks=None):
        """``labels``: [b, T] every target's token, or with ``at_targets_only`` [n] the targets' at
        (``rows``, ``cols``): the loss targets', or every target's with ``picks`` (the loss targets
        among them, for ``loss_fn``)."""
        if at_targets_only:  # output: [1, n, v / tp], the rows at each trajectory's targets in turn
            labels = labels[None]
        logps, entropies = vocab_parallel_logprobs(output, labels, pgs.tp, need_entropy, temperature)
        lengths = [items[k].tokens.shape[0] - 1 for k in ks]
        if at_targets_only:  # [1, n]: the loss targets already, in order
            logp_N, entropy_N = logps[0], None if entropies is None else entropies[0]
            logp_rows = _at_targets(logp_N.detach(), rows, cols, lengths)
            entropy_rows = None if entropy_N is None else _at_targets(entropy_N.detach(), rows, cols, lengths)
        else:  # [b, T]: every target of each row
            if dims.cp > 1:  # one trajectory per micro-batch, its sequence shards gathered
                logps = gather_sequence(logps[0], pgs)[None]
                entropies = None if entropies is None else gather_sequence(entropies[0], pgs)[None]
            logp_N = logps[rows, cols]
            entropy_N = None if entropies is None else entropies[rows, cols]
            logp_rows = [logps[row, :n].detach() for row, n in enumerate(lengths)]
            entropy_rows = None if entropies is None else [entropies[row, :n].detach() for row, n in enumerate(lengths)]
        reports = [{"logp": logp} if entropy_rows is None else {"logp": logp, "entropy": entropy_rows[row]}
                   for row, logp in enumerate(logp_rows)]
        if picks is not None:
            logp_N, entropy_N = logp_N[picks], None if entropy_N is None else entropy_N[picks]
        return loss_fn(ks, logp_N, entropy_N), torch.ones((), dtype=torch.int, device=device), reports

    extra = {}
    if pgs.dims.pp > 1:
        config = ddp_model.config
        config.variable_seq_lengths = True  # every micro-batch its own [T_max, b] (shapes are sent first)
        extra["p2p_communicator"] = P2PCommunicator(pp_group=pgs.pp, config=config)
    try:
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=index,
            model=[ddp_model],
            num_microbatches=len(groups),
            seq_length=max(lengths),
            micro_batch_size=max(len(mb) for mb, _ in shared) if shared else max(len(ks) for ks in groups),
            forward_only=forward_only,
            pg_collection=pgs.collection,
            **extra,
        )
    finally:
        if replay is not None:
            replay.close()
        if router_losses is not None:
            router_losses.close()
    reports = [report for micro_batch in out for report in micro_batch]  # in the groups' order
    if not reports:  # not the last stage
        return reports
    in_order: list[dict] = [{}] * len(items)
    for k, report in zip((k for ks in groups for k in ks), reports, strict=True):
        in_order[k] = report
    return in_order


def _inputs_and_labels(tokens: Sequence[torch.Tensor], width: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's [b, width] inputs (each row's tokens but its last) and labels (but its
    first), zero-padded on the right: one scatter for all rows, not two copies per row."""
    flat = torch.cat(list(tokens)).to(device)
    n = torch.tensor([t.shape[0] - 1 for t in tokens], device=device)  # targets per row
    rows = torch.repeat_interleave(torch.arange(len(tokens), device=device), n)
    first = torch.cumsum(n, 0) - n  # each row's first target among all rows' targets
    cols = torch.arange(rows.numel(), device=device) - first[rows]
    source = cols + (first + torch.arange(len(tokens), device=device))[rows]  # token t of its row in ``flat``
    inputs = torch.zeros(len(tokens), width, dtype=torch.long, device=device)
    labels = torch.zeros_like(inputs)
    inputs[rows, cols] = flat[source]
    labels[rows, cols] = flat[source + 1]
    return inputs, labels


def _at_targets(flat: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                lengths: Sequence[int]) -> list[torch.Tensor]:
    """Values at the loss targets (``rows``, ``cols``) in turn, [n] -> one [length] tensor per row
    holding them at its targets and zeros (off the graph) elsewhere (views of one [b, max length])."""
    full = flat.new_zeros(len(lengths), max(lengths))
    full[rows, cols] = flat
    return [full[row, :length] for row, length in enumerate(lengths)]


class _LossRows:
    """The last stage's output layer, restricted for one forward to the rows at the loss's targets
    (``learner.loss_logits_only``): a forward pre-hook replaces its input [s, b, h] (a sequence
    shard under SP) with [n, 1, h], the rows (position t, row r) of ``select``'s targets in order.

    Under SP the layer runs without its own sequence gather for that call. Its input gradient is
    then all-reduced over TP by the layer (``copy_to_tensor_model_parallel_region``: each rank's
    vocabulary shard contributes a part), so the hook's gather must hand back only this rank's
    positions of that sum (``tensor_parallel_output_grad=False``), not reduce-scatter it again:
    together the same TP sum of each rank's own positions the SP layer's reduce-scatter gives."""

    def __init__(self, layer: torch.nn.Module, pgs: ProcessGroups) -> None:
        self.layer, self.pgs = layer, pgs

    @classmethod
    def of(cls, ddp_model: torch.nn.Module, pgs: ProcessGroups) -> _LossRows | None:
        """The hook for this rank's model chunk; None off the last pipeline stage (no output layer)."""
        if not pgs.is_last_stage:
            return None
        return cls(get_attr_wrapped_model(ddp_model, "output_layer"), pgs)

    @contextlib.contextmanager
    def select(self, rows: torch.Tensor, positions: torch.Tensor, batch: int) -> Iterator[None]:
        """For the next forward: the output layer's rows at (``rows``, ``positions``) in turn."""
        index = positions * batch + rows  # into [s * b], s-major
        sequence_parallel = bool(getattr(self.layer, "sequence_parallel", False))

        def pre_hook(_module, args, kwargs):
            hidden = args[0]
            if sequence_parallel:  # the whole sequence first (its backward: this rank's positions)
                hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                              group=self.pgs.tp)
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index).unsqueeze(1)
            return (hidden, *args[1:]), kwargs

        handle = self.layer.register_forward_pre_hook(pre_hook, with_kwargs=True)
        if sequence_parallel:
            self.layer.sequence_parallel = False
        try:
            yield
        finally:
            handle.remove()
            if sequence_parallel:
                self.layer.sequence_parallel = True


def padded_length(num_targets: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that holds ``num_targets`` positions."""
    return -(-num_targets // multiple) * multiple


def cp_positions(length: int, cp: int, rank: int, device: torch.device) -> torch.Tensor:
    """The positions of a ``length``-long sequence that context-parallel rank ``rank`` holds:
    chunks rank and 2 cp - 1 - rank of 2 cp (``megatron.core.utils.get_batch_on_this_cp_rank``)."""
    chunk = length // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


class _GatherSequence(torch.autograd.Function):
    """Forward: every CP rank's per-position values, in sequence order, on every rank. Backward:
    this rank's positions of the gradient (each rank holds the same loss of the whole sequence,
    so the gradient of its own positions is its whole share; nothing is summed)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, pgs: ProcessGroups) -> torch.Tensor:
        cp = pgs.dims.cp
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=pgs.cp)
        length = local.numel() * cp
        full = local.new_empty(length)
        for rank, part in enumerate(parts):
            full[cp_positions(length, cp, rank, local.device)] = part
        ctx.positions = cp_positions(length, cp, pgs.cp_rank, local.device)
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.positions], None


def gather_sequence(local: torch.Tensor, pgs: ProcessGroups) -> torch.Tensor:
    """Per-position values [s / cp] of this CP rank's chunks -> [s] in sequence order."""
    out = _GatherSequence.apply(local, pgs)
    assert isinstance(out, torch.Tensor)
    return out


class MegatronBackend:
    """``GradientBackend`` over a Megatron ``DistributedDataParallel`` model chunk."""

    def __init__(self, ddp_model: DistributedDataParallel, pgs: ProcessGroups, objective: RLObjective | None,
                 temperature: float = 1.0, pack_tokens: int = 0, router_losses: bool = False,
                 loss_logits_only: bool = False, share_prefixes: bool = False) -> None:
        self.ddp = ddp_model
        self.pack_tokens = pack_tokens  # learner.pack_tokens: backward_sum's micro-batches
        self.loss_logits_only = loss_logits_only  # learner.loss_logits_only: the head at the loss's targets
        self.share_prefixes = share_prefixes  # learner.share_prefixes, where the model supports it
        self.pgs = pgs
        self.objective = objective
        self.temperature = temperature  # the sampling temperature: logprobs of softmax(z / T)
        self.router_losses = router_losses  # learner.moe: a reward-free pass adds the routers' losses
        buffers = list(ddp_model.buffers) + list(getattr(ddp_model, "expert_parallel_buffers", []))
        self.live = GradBuffer([b.grad_data for b in buffers])
        self.num_backward = 0

    def zeros(self) -> GradBuffer:
        return GradBuffer.zeros_like(self.live)

    def _objective(self) -> RLObjective:
        if self.objective is None:
            raise TypeError("this learner's objective has no reward part (objective.kind=opd)")
        return self.objective

    def backward(self, traj: Trajectory, specs: Sequence[LossSpec]) -> Iterator[GradBuffer]:
        # One schedule call per spec: a pipeline schedule runs exactly one backward per forward.
        objective = self._objective()
        for spec in specs:

            def loss(_ks: Sequence[int], logp: torch.Tensor, ent: torch.Tensor | None,
                     spec: LossSpec = spec) -> torch.Tensor:
                return trajectories_loss(logp, ent, [traj], [spec], objective)

            self.ddp.zero_grad_buffer()
            with self.ddp.no_sync():
                run_schedule(self.ddp, self.pgs, [traj], loss, need_entropy=objective.entropy_coef > 0,
                             temperature=self.temperature, router_weights=self._router_weights([traj], [spec]),
                             loss_logits_only=self.loss_logits_only)
            self.num_backward += 1
            yield self.live

    def backward_sum(self, trajs: Sequence[Trajectory], specs: Sequence[LossSpec]) -> GradBuffer:
        """Sum of several trajectories' gradients from one schedule call (pipelined under PP), packed
        into micro-batches of at most ``learner.pack_tokens`` tokens."""
        objective = self._objective()
        self.ddp.zero_grad_buffer()
        with self.ddp.no_sync():
            run_schedule(
                self.ddp, self.pgs, list(trajs),
                lambda ks, logp, ent: trajectories_loss(logp, ent, [trajs[k] for k in ks], [specs[k] for k in ks],
                                                        objective),
                need_entropy=objective.entropy_coef > 0, temperature=self.temperature,
                pack_tokens=self.pack_tokens, router_weights=self._router_weights(trajs, specs),
                loss_logits_only=self.loss_logits_only, share_prefixes=self.share_prefixes,
            )
        self.num_backward += len(trajs)
        return self.live

    def _router_weights(self, trajs: Sequence[Trajectory], specs: Sequence[LossSpec]) -> list[float] | None:
        if not self.router_losses:
            return None
        objective = self._objective()
        return [router_loss_weight(t, s, objective) for t, s in zip(trajs, specs, strict=True)]

    def load_grad(self, grad: GradBuffer) -> None:
        self.live.copy_(grad)
