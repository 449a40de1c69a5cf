"""Shared prefixes: a group's trajectories forwarded as one row, their common prefix once
(``learner.share_prefixes``).

GRPO samples several completions of one prompt, and a training pass over the batch forwards and
backwards that prompt once per sample: on the quickstart (prompts of ~36 tokens, 8 new tokens, 8
samples a group) 80% of the pass's positions are prompt copies, and an agentic task's long system
prompt and task statement repeat the same way. Here a schedule call's trajectories of one group
share a packed row::

    [ P | s_1 | s_2 | ... | s_m | pads ]      P: the members' common input prefix, p positions
                                              s_i: member i's remaining inputs x_i[p:n_i]

with each column's own position (RoPE reads them: every suffix restarts at p; a forward hook on the
model's rotary embedding hands each row its positions) and an attention mask: a prefix query sees
the prefix causally, a suffix query the whole prefix and its own suffix causally, never another
suffix; pads see only pads (no softmax row is empty) and no real query sees a pad. The output
layer reads the rows at each trajectory's loss targets (``micro_batches.HeadAtTargets``, as
``learner.loss_logits_only``):
target t of member i at column c_i(t) = t for t < p, else start_i + (t - p) -- the prefix's last
column once per member (it predicts each member's first suffix token).

Why it is exact. In a causal decoder the hidden state at position t is a function of the tokens at
positions <= t of its own sequence, each with its position: only attention mixes positions, and
only through its mask; norms, projections and the MLP act per position. In the shared row the query
at c_i(t) sees exactly the columns that hold i's tokens 0..t at positions 0..t -- the same function
of the same inputs as in i's own row. So each loss term is the same function of the weights, the
loss (a sum over trajectories, each with its own per-sequence factors) the same sum, and the gradient
the same gradient. What changes is the order of floating-point sums: the prefix's share, which an
unshared pass computes once per member and sums in the weight-gradient GEMMs, arrives here summed over
the members first (the attention's backward over the members' queries, the head gather's backward over
the repeated last column). Equal up to rounding, not bitwise
(``tests/distributed/test_learner.py::test_shared_prefixes_give_the_unshared_gradient``).

Cost: m trajectories of n positions with a common prefix of p cost p + m (n - p) positions instead of
m n (the quickstart: ~100 instead of 352 a group). The mask is [rows, 1, W, W] booleans per
micro-batch, W the longest row (at most ``min(learner.pack_tokens, MAX_ROW)``); torch's fused
attention takes it.

Applies to training passes (with ``learner.loss_logits_only``) and forward-only scoring (the
reference model's and PPO's old logprobs: the head then reads every target's column) of dense models
on our core attention (``SDPAttention``: the local spec's ``sdpa``/``past_kv``), with ``pack_tokens``
> 0, outside context parallelism; not with MoE (its router losses count each position once per
trajectory, and routing replay holds per-trajectory routes). Elsewhere -- and when no two
trajectories of a call share a group -- a pass packs one trajectory per row as before.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from megatron.core.utils import get_attr_wrapped_model

from megathunder.learner.sdpa_attention import SDPAttention
from megathunder.trajectory import Trajectory

log = logging.getLogger(__name__)

PAD, PREFIX = -2, -1  # segment ids of a row's columns; a member's suffix is its index in the row
MAX_ROW = 4096
"""The most positions of one shared row: its mask is W x W booleans (16 MiB at 4096), so a
micro-batch's masks stay within pack_tokens x MAX_ROW bytes however large ``pack_tokens`` is; a
longer group is split into several rows, each with the prefix."""


def supported(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a GPTModel, possibly wrapped) can take shared rows: every core attention
    ours (it reads the mask), rotary positions (the hook gives them per column), no experts."""
    return unsupported_because(model) is None


def unsupported_because(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot take shared rows (None: it can)."""
    cores = [m.core_attention for m in model.modules() if hasattr(m, "core_attention")]
    config = get_attr_wrapped_model(model, "config")
    if not cores or not all(isinstance(c, SDPAttention) for c in cores):
        return "its core attention is not megathunder's (the Transformer Engine spec, or a fused one): it cannot read a row's mask"
    if get_attr_wrapped_model(model, "position_embedding_type") != "rope" or config.apply_rope_fusion:
        return "its positions are not unfused rotary ones, which shared rows set per column"
    if config.num_moe_experts:
        return "a MoE model's router losses and routing replay see whole rows"
    return None


def resolve(requested: bool, model: torch.nn.Module, report: bool = True) -> bool:
    """``learner.share_prefixes`` as it applies to ``model``: on when asked and supported; when asked
    and not supported, off with one line saying why (``report``: this rank says it)."""
    if not requested:
        return False
    why = unsupported_because(model)
    if why is not None and report:
        log.warning("learner.share_prefixes: off for this model (%s); each trajectory is forwarded whole", why)
    return why is None


@dataclass(frozen=True)
class SharedRow:
    """One packed row: the members (indices into the schedule's trajectories), in order, and the
    number of input positions they share."""

    members: list[int]
    prefix: int
    width: int  # prefix + every member's suffix


def shared_rows(items: Sequence[Trajectory], max_tokens: int) -> list[SharedRow]:
    """The trajectories' rows: each group's members (by ``group_id``, in order of first appearance)
    in rows of at most ``max_tokens`` positions (a member that alone exceeds it is a row of its own),
    sharing the group's longest common input prefix (inputs: ``tokens[:-1]``)."""
    groups: dict[int, list[int]] = {}
    for k, traj in enumerate(items):
        groups.setdefault(traj.group_id, []).append(k)
    rows: list[SharedRow] = []
    for members in groups.values():
        n = [items[k].tokens.numel() - 1 for k in members]
        p = _common_prefix([items[k].tokens[: min(n)] for k in members])
        row: list[int] = []
        width = p
        for k, length in zip(members, n, strict=True):
            if row and width + length - p > max_tokens:
                rows.append(SharedRow(row, p, width))
                row, width = [], p
            row.append(k)
            width += length - p
        rows.append(SharedRow(row, p, width))
    return rows


def _common_prefix(prefixes: Sequence[torch.Tensor]) -> int:
    """The length of the longest common prefix of equally long token tensors."""
    stacked = torch.stack(list(prefixes))
    differs = (stacked != stacked[0]).any(0).nonzero()
    return int(differs[0]) if differs.numel() else stacked.shape[1]


@dataclass
class SharedMicroBatch:
    """The tensors of one micro-batch of shared rows."""

    ks: list[int]  # its trajectories, row after row, members in order
    inputs: torch.Tensor  # [b, W] token ids, pads 0
    positions: torch.Tensor  # [b, W] each column's position in its trajectory, pads 0
    mask: torch.Tensor  # [b, 1, W, W] True where a query must not see a key (Megatron's convention)
    head_rows: torch.Tensor  # [N] the packed (row, column) of every loss target, trajectory after trajectory
    head_cols: torch.Tensor
    labels: torch.Tensor  # [N] each target's token
    rows: torch.Tensor  # [N] each target's trajectory (index into ks) and its position there
    cols: torch.Tensor


def micro_batch(items: Sequence[Trajectory], rows: Sequence[SharedRow], width: int, counts: Sequence[int],
                at: Sequence[torch.Tensor], device: torch.device) -> SharedMicroBatch:
    """The micro-batch of ``rows``, padded to ``width``. ``counts`` / ``at``: every item's number of
    loss targets and their positions (``trajectory.loss_targets``)."""
    pieces: list[torch.Tensor] = []  # the row's prefix, then each member's suffix, row after row
    layout: list[tuple[int, int, int, int]] = []  # each piece's row, first position, segment, first column
    ks: list[int] = []
    member: list[tuple[int, int, int]] = []  # each trajectory's row, prefix and first suffix column
    for r, row in enumerate(rows):
        p = row.prefix
        pieces.append(items[row.members[0]].tokens[:p])
        layout.append((r, 0, PREFIX, 0))
        col = p
        for j, k in enumerate(row.members):
            pieces.append(items[k].tokens[p:-1])
            layout.append((r, p, j, col))
            ks.append(k)
            member.append((r, p, col))
            col += items[k].tokens.numel() - 1 - p
    piece_row, piece_base, piece_seg, piece_col = torch.tensor(layout).unbind(1)
    member_row, member_prefix, member_start = torch.tensor(member).unbind(1)
    lengths = torch.tensor([t.numel() for t in pieces])
    piece = torch.repeat_interleave(torch.arange(len(pieces)), lengths)  # each column's piece
    within = torch.arange(piece.numel()) - (torch.cumsum(lengths, 0) - lengths)[piece]
    b_idx = piece_row[piece]
    c_idx = piece_col[piece] + within
    inputs = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros_like(inputs)
    segment = torch.full_like(inputs, PAD)
    inputs[b_idx, c_idx] = torch.cat(pieces)
    positions[b_idx, c_idx] = piece_base[piece] + within
    segment[b_idx, c_idx] = piece_seg[piece]
    q_seg, k_seg = segment[:, :, None], segment[:, None, :]
    visible = (positions[:, None, :] <= positions[:, :, None]) & (
        (k_seg == q_seg) | ((k_seg == PREFIX) & (q_seg != PAD)))

    # every loss target: its trajectory (index into ks), own position, packed column and token
    n = torch.tensor([counts[k] for k in ks])
    owner = torch.repeat_interleave(torch.arange(len(ks)), n)
    own = torch.cat([at[k] for k in ks]) if ks else torch.zeros(0, dtype=torch.long)
    prefix, start = member_prefix[owner], member_start[owner]
    head_cols = torch.where(own < prefix, own, start + own - prefix)
    labels = torch.cat([items[k].tokens[1:] for k in ks])
    first = torch.tensor([items[k].tokens.numel() - 1 for k in ks])
    first = (torch.cumsum(first, 0) - first)[owner]  # each target's trajectory's first label in ``labels``
    return SharedMicroBatch(
        ks=ks, inputs=inputs.to(device), positions=positions.to(device), mask=(~visible)[:, None].to(device),
        head_rows=member_row[owner].to(device), head_cols=head_cols.to(device),
        labels=labels[first + own].to(device), rows=owner.to(device), cols=own.to(device))


@contextlib.contextmanager
def rotary_positions(model: torch.nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """For the next forward: the model's rotary embedding at ``positions`` [b, s], one per column
    ([s, b, 1, d], which Megatron's RoPE broadcasts over heads), instead of 0..s-1 for every row."""
    rotary = get_attr_wrapped_model(model, "rotary_pos_emb")
    b, s = positions.shape
    index = positions.t().reshape(-1)

    def hook(_module, _args, emb):  # [S, 1, 1, d], S >= s
        return emb[index, 0, 0].view(s, b, 1, emb.shape[-1])

    handle = rotary.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
