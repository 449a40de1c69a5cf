"""How one schedule call lays its trajectories out as micro-batches: a small strategy per layout,
each building every micro-batch's (inputs, positions, mask, the rows the head reads, targets).

    PackedRows           several trajectories a micro-batch, one a row, right-padded (the default)
    ContextParallelRows  one trajectory a micro-batch, split over the CP ranks
    SharedPrefixRows     a group's trajectories in one row, their common prefix once
                         (``megathunder.learner.shared_prefix`` derives why it is exact)
    HeadAtTargets        the output layer only at the rows the loss reads (``learner.loss_logits_only``)

``megathunder.learner.forward_backward`` picks one per call and runs Megatron's schedule over it.

Long trajectories. Under sequence parallelism the sequence is split over the TP ranks and under
context parallelism over the CP ranks (Megatron's load-balanced layout: 2 x CP chunks, rank r
holding chunks r and 2CP - 1 - r), and FP8 GEMMs take token counts of a multiple of 16 (32 for
MXFP8), so each trajectory's inputs are padded at the end to a multiple of
``ParallelDims.seq_multiple``, which covers all three. Padding is exact: attention is causal, so no real position sees a
pad, and the pads' targets are cut off before the loss, so their rows carry zero gradient. Under CP
each rank's logits cover its own chunks; their token logprobs (and entropies) are gathered into the
whole sequence with a gather whose backward returns each rank its own positions' share
(``gather_sequence``), so ``loss_fn`` still sees one whole trajectory -- per-sequence terms (the
aggregation's nu_i, sequence-level TIS) stay what they are -- and every CP rank computes the same
loss; each rank's backward then covers the paths through its own chunks, and the DP x CP gradient
reduction in ``step`` sums them into the trajectory's gradient.

Packing (``learner.pack_tokens``). A schedule call over many short trajectories would pay one
micro-batch's fixed cost (a forward and a backward's launches, a pipeline hand-off) per trajectory
-- on the quickstart that overhead, not the arithmetic, set the step time. So ``PackedRows``
groups the trajectories, longest first, into micro-batches of at most ``pack_tokens`` tokens,
counted as rows x longest padded length (``megathunder.trajectory.pack_micro_batches``: rows of
nearly equal length, so little is padded; a trajectory longer than the cap is a micro-batch
alone), each one [rows, T_max] forward, right-padded. It is exact for the same reasons padding
is, one row at a time: nothing in the model mixes the rows of a batch (attention is per row and
causal, norms, RoPE and matmuls act per position), every row starts at position 0, and each row's
pads come after its real positions, their targets cut off before the loss. The micro-batch's loss
is the sum of its rows' losses, each ``loss_fn(k, ...)`` given one whole trajectory's logprobs, so
per-sequence terms stay exact and the gradient is the sum of the trajectories' gradients --
reassociated (a weight gradient's GEMM sums a micro-batch's tokens at once), so equal up to fp32
rounding, not bitwise. Under PP the micro-batches' shapes vary in both the sequence and the batch
dimension; Megatron's ``variable_seq_lengths`` sends each hand-off's full shape first, so no row
padding is needed. Under SP the padded length is a multiple of TP as before (the batch dimension is
not split). Under CP the sequence gather is per trajectory, so CP falls back to one trajectory per
micro-batch (``ContextParallelRows``).

Logits at the loss's targets only (``learner.loss_logits_only``, training passes). The output
layer's input, [T_max, b, h] on the last stage, is cut to the rows at the micro-batch's loss-mask
targets, [n, 1, h], by a pre-hook on the layer for the duration of one forward (``HeadAtTargets``);
the loss computes their logprobs and puts each trajectory's back at its positions, zeros elsewhere,
with no path to the graph there (``to_rows``). Exact: every loss reads its terms through its
effective mask, a subset of the loss mask, with ``torch.where``, so what sits at the other
positions never reaches a loss or a gradient; and the rows the head sees are the same hidden
states. Under sequence parallelism the layer's input is a sequence shard: the hook gathers it first
and runs the layer without its SP gather for that call, so each rank's input gradient is still the
TP sum of its own positions (``HeadAtTargets``). Not under context parallelism.

Shared prefixes (``learner.share_prefixes``). A group's trajectories share one row, their common
prefix (the prompt) forwarded once, each suffix at its own positions under a prefix + own-suffix
attention mask; the head reads each trajectory's targets through ``HeadAtTargets``
(``megathunder.learner.shared_prefix`` derives why it is exact). A forward-only call reads the head
at every target through the same row gather, and hands the loss its loss targets' values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.utils import get_attr_wrapped_model

from megathunder.learner.parallel import ProcessGroups
from megathunder.learner.shared_prefix import MAX_ROW, SharedRow, micro_batch, rotary_positions, shared_rows
from megathunder.trajectory import Trajectory, loss_targets, pack_micro_batches


@dataclass(frozen=True)
class MicroBatch:
    """One forward's tensors and where its loss reads them."""

    ks: list[int]  # its trajectories (indices into the call's), in the order their targets come
    inputs: torch.Tensor  # [b, W] token ids, pads 0 (under CP this rank's chunks)
    positions: torch.Tensor  # [b, W] each column's position in its trajectory
    mask: torch.Tensor | None  # [b, 1, W, W] True where a query must not see a key; None: causal
    width: int  # W before any CP split (what router losses and routing replay are set to)
    labels: torch.Tensor  # [b, W] every column's target; with ``head`` [n], the head's targets'
    rows: torch.Tensor  # [n] each target the loss reads: its trajectory (index into ks) ...
    cols: torch.Tensor  # ... and its position there
    head: tuple[torch.Tensor, torch.Tensor] | None = None  # the packed (row, column) the head reads; None: all
    picks: torch.Tensor | None = None  # among the head's targets, the loss's (scoring every target)


class PackedRows:
    """Trajectories, longest first, in micro-batches of at most ``pack_tokens`` tokens, one a row
    right-padded to the micro-batch's longest (module docstring: Packing). ``at_targets``: the
    head reads only each trajectory's loss targets."""

    head_at_targets: bool

    def __init__(self, items: Sequence[Trajectory], seq_multiple: int, pack_tokens: int, at_targets: bool,
                 device: torch.device) -> None:
        self.items, self.device, self.head_at_targets = items, device, at_targets
        self.lengths = [padded_length(t.tokens.numel() - 1, seq_multiple) for t in items]
        self.counts, self.at = loss_targets(items)  # each trajectory's loss targets
        self.groups = pack_micro_batches(self.lengths, pack_tokens)
        self.seq_length = max(self.lengths)
        self.micro_batch_size = max(len(ks) for ks in self.groups)

    def micro_batch(self, i: int) -> MicroBatch:
        ks = self.groups[i]
        width = max(self.lengths[k] for k in ks)
        inputs, labels = _inputs_and_labels([self.items[k].tokens for k in ks], width, self.device)
        positions = torch.arange(width, device=self.device)[None].expand(len(ks), width)
        inputs, labels, positions = self._local(inputs, labels, positions)
        # (row, position) of every loss target of the micro-batch, trajectory after trajectory
        cols = torch.cat([self.at[k] for k in ks]).to(self.device)
        rows = torch.repeat_interleave(torch.arange(len(ks)), torch.tensor([self.counts[k] for k in ks]))
        rows = rows.to(self.device)
        if not self.head_at_targets:
            return MicroBatch(ks, inputs, positions, None, width, labels, rows, cols)
        return MicroBatch(ks, inputs, positions, None, width, labels[rows, cols], rows, cols, head=(rows, cols))

    def _local(self, inputs: torch.Tensor, labels: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What this rank forwards of the micro-batch: all of it."""
        return inputs, labels, positions

    def forward_context(self, model: torch.nn.Module, mb: MicroBatch) -> ContextManager[None]:
        """Around the micro-batch's forward: nothing (every row at positions 0..W-1)."""
        return contextlib.nullcontext()

    def whole(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position values [b, W] of this rank -> of the whole rows: already."""
        return values


class ContextParallelRows(PackedRows):
    """One trajectory a micro-batch, this CP rank's chunks of it (module docstring: Long
    trajectories); its logprobs gathered into the whole sequence before the loss."""

    def __init__(self, items: Sequence[Trajectory], pgs: ProcessGroups) -> None:
        super().__init__(items, pgs.dims.seq_multiple, 0, False, pgs.device)
        self.pgs = pgs

    def _local(self, inputs: torch.Tensor, labels: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from megatron.core.utils import get_batch_on_this_cp_rank

        local = get_batch_on_this_cp_rank({"tokens": inputs, "labels": labels, "position_ids": positions}, self.pgs.cp)
        return local["tokens"], local["labels"], local["position_ids"]

    def whole(self, values: torch.Tensor) -> torch.Tensor:
        return gather_sequence(values[0], self.pgs)[None]


class SharedPrefixRows:
    """Each group's trajectories in shared rows, their common prefix once, the rows packed into
    micro-batches of at most ``pack_tokens`` tokens (``megathunder.learner.shared_prefix``). The
    head reads each trajectory's loss targets through the row gather; ``scoring`` (forward-only):
    every target through the same gather, the loss's picked from them."""

    head_at_targets = True

    def __init__(self, items: Sequence[Trajectory], rows: Sequence[SharedRow], seq_multiple: int, pack_tokens: int,
                 scoring: bool, device: torch.device) -> None:
        self.items, self.device = items, device
        widths = [padded_length(row.width, seq_multiple) for row in rows]
        self.batches = [([rows[r] for r in mb], max(widths[r] for r in mb))
                        for mb in pack_micro_batches(widths, pack_tokens)]
        self.groups = [[k for row in mb for k in row.members] for mb, _ in self.batches]
        self.seq_length = max(widths)
        self.micro_batch_size = max(len(mb) for mb, _ in self.batches)
        self.counts, self.at = loss_targets(items)
        self.loss_at: list[torch.Tensor] | None = None
        if scoring:  # the head at every target, through the same gather
            self.loss_at = self.at
            self.counts = [t.tokens.numel() - 1 for t in items]
            self.at = [torch.arange(n) for n in self.counts]

    @classmethod
    def of(cls, items: Sequence[Trajectory], seq_multiple: int, pack_tokens: int, scoring: bool,
           device: torch.device) -> SharedPrefixRows | None:
        """The layout, or None when no two trajectories share a row (then one a row: ``PackedRows``)."""
        rows = shared_rows(items, min(pack_tokens, MAX_ROW))
        if not any(len(row.members) > 1 for row in rows):
            return None
        return cls(items, rows, seq_multiple, pack_tokens, scoring, device)

    def micro_batch(self, i: int) -> MicroBatch:
        mb_rows, width = self.batches[i]
        mb = micro_batch(self.items, mb_rows, width, self.counts, self.at, self.device)
        picks = None
        if self.loss_at is not None:  # scoring every target: the loss still gets the loss targets' values
            n = torch.tensor([self.counts[k] for k in mb.ks])
            first = torch.cumsum(n, 0) - n  # each trajectory's first target among the micro-batch's
            picks = torch.cat([self.loss_at[k] + first[j] for j, k in enumerate(mb.ks)]).to(self.device)
        return MicroBatch(mb.ks, mb.inputs, mb.positions, mb.mask, width, mb.labels, mb.rows, mb.cols,
                          head=(mb.head_rows, mb.head_cols), picks=picks)

    def forward_context(self, model: torch.nn.Module, mb: MicroBatch) -> ContextManager[None]:
        """Around the micro-batch's forward: RoPE at each column's own position."""
        return rotary_positions(model, mb.positions)

    def whole(self, values: torch.Tensor) -> torch.Tensor:
        return values


Layout = PackedRows | SharedPrefixRows


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


def to_rows(flat: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
               lengths: Sequence[int]) -> list[torch.Tensor]:
    """Values at the loss targets (``rows``, ``cols``) in turn, [n] -> one [length] tensor per row
    holding them at its targets and zeros (off the graph) elsewhere (views of one [b, max length])."""
    full = flat.new_zeros(len(lengths), max(lengths))
    full[rows, cols] = flat
    return [full[row, :length] for row, length in enumerate(lengths)]


class HeadAtTargets:
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
    def of(cls, model: torch.nn.Module, pgs: ProcessGroups) -> HeadAtTargets | None:
        """The hook for this rank's model chunk; None off the last pipeline stage (no output layer)."""
        if not pgs.is_last_stage:
            return None
        return cls(get_attr_wrapped_model(model, "output_layer"), pgs)

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
