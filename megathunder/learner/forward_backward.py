"""The learner's one forward-backward: every gradient and every score the learner computes over
whole trajectories is one call of Megatron's own schedule (pipeline parallel included), through
``ForwardBackward``, built once with the learner from its ``LearnerConfig``::

    passes  = learner.forward_backward.backward(trajs, loss_fn, router_weights)  # adds into DDP's buffers
    reports = learner.forward_backward.forward(trajs)                            # forward-only scoring

``loss_fn(ks, logp_N, entropy_N)`` is the loss of the micro-batch's trajectories ``ks`` (indices
into ``trajs``) from their logprobs (and entropies) of softmax(logits / T) at their loss-mask
targets, concatenated in order (``objectives.trajectories_loss``: one flat computation, each
trajectory's own per-sequence terms); a micro-batch's loss is the sum of its trajectories', so a
call's gradient is the sum of every trajectory's. How the trajectories become micro-batches -- one
per row packed, a group's common prefix shared, context parallel, the head only at the loss's
targets -- is a small strategy of ``megathunder.learner.micro_batches``, which derives why each is
exact; the options that choose it (``PassOptions``) are read once from the config, never passed by
the callers. All ranks of one model-parallel group (TP and PP peers) must make the same calls with
the same trajectories in the same order: the schedule communicates between them.

Router losses (``learner.moe.aux_loss_coeff`` / ``z_loss_coeff``). Each micro-batch's rows get
their trajectories' router-loss weights just before its forward (``router_weights``: the pass's
weight of each trajectory, 0 in a score-only pass; ``megathunder.learner.router_losses`` derives
why the streamed sum is the batch's).

Routing replay (``learner.moe.routing_replay``). When the model replays and the trajectories carry
the engine's routed experts, each micro-batch's rows are handed to the routers just before its
forward (``megathunder.learner.routing_replay``).

Both hold per-trajectory state a shared row would mix, so a call with either lays out one
trajectory a row.

Pass counts. ``backward`` returns how many trajectories' backward passes it ran (``Passes``) and
``num_passes`` adds them up for the learner's life: a batch reads it when it begins and when it
asks (``megathunder.learner.batches``), so the count of the gradient ledger's passes, which reach
the ledger and not the batch, is never reset from outside.

Own gradients in one call (``backward_each``): the gradient ledger needs some trajectories' gradients
each on its own (a slot's S and R, a pending h_i). One call per trajectory runs each alone through
the pipeline stages (PP - 1 stages idle at any moment); ``backward_each`` runs them as the micro-batches
of one call, one trajectory each, and hands each stage's gradient storage to the caller right after
that micro-batch's backward on the stage, then zeroes it. A stage runs its micro-batches' backwards
one after another in order (1F1B and the unpipelined schedule alike), and a micro-batch's backward
adds only its own gradient into the stage's zeroed buffers, so what the caller gets for trajectory
k is, element for element, what a call of trajectory k alone leaves there: the same micro-batch
(``PackedRows`` of one trajectory), the same kernels, added into zeros. Megatron 0.16's schedules
have no per-micro-batch hook; they call their module's ``backward_step`` by name, which
``_after_each_backward`` wraps for the length of the call (and a call whose count of backwards
does not come out right raises).

The gradient storage the batches see (``GradientSpace``) is DDP's flat buffers
(``DistributedDataParallel.buffers[*].grad_data``, every parameter's ``main_grad`` a view of them):
``backward`` adds into them inside ``no_sync`` (no data-parallel communication per call), and
``step`` reduces what a batch left there across data-parallel ranks once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel import schedules as megatron_schedules
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megathunder.config import LearnerConfig
from megathunder.learner import shared_prefix
from megathunder.learner.logprobs import vocab_parallel_logprobs
from megathunder.learner.micro_batches import (
    ContextParallelRows,
    HeadAtTargets,
    Layout,
    MicroBatch,
    PackedRows,
    SharedPrefixRows,
    to_rows,
)
from megathunder.learner.parallel import ProcessGroups
from megathunder.learner.router_losses import ScheduleRouterLosses, schedule_router_losses
from megathunder.learner.routing_replay import ScheduleReplay, schedule_replay
from megathunder.streaming.buffers import GradBuffer
from megathunder.trajectory import Trajectory

LossFn = Callable[[Sequence[int], torch.Tensor, torch.Tensor | None], torch.Tensor]
Report = dict[str, torch.Tensor]  # a trajectory's detached "logp" (and "entropy") at every target


@dataclass(frozen=True)
class PassOptions:
    """How a call lays out its micro-batches (``LearnerConfig``; module docstring)."""

    pack_tokens: int = 0  # learner.pack_tokens (0: one trajectory per micro-batch)
    loss_logits_only: bool = False  # learner.loss_logits_only: a training pass's head at the loss's targets
    share_prefixes: bool = False  # learner.share_prefixes, where the model supports it
    temperature: float = 1.0  # the sampling temperature: logprobs of softmax(z / T)

    @classmethod
    def of(cls, cfg: LearnerConfig, model: torch.nn.Module, temperature: float, report: bool = True) -> PassOptions:
        """``report``: this rank says so when ``learner.share_prefixes`` cannot apply to ``model``."""
        return cls(cfg.pack_tokens, cfg.loss_logits_only, shared_prefix.resolve(cfg.share_prefixes, model, report),
                   temperature)


@dataclass(frozen=True)
class Passes:
    """What one ``backward`` ran."""

    count: int  # trajectories' backward passes (one each, however they were packed)
    reports: list[Report] = field(default_factory=list)  # last stage: one per trajectory, in order; else none


def grad_data(ddp: DistributedDataParallel) -> list[torch.Tensor]:
    """DDP's flat gradient buffers, dense and expert: every parameter's ``main_grad`` is a view of one."""
    return [b.grad_data for b in list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))]


class GradientSpace:
    """This rank's gradient storage as the batches see it: DDP's flat buffers (dense and expert)
    as one ``GradBuffer`` (``live``), new buffers laid out like it, and zeroing."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self._ddp = ddp
        self.live = GradBuffer(grad_data(ddp))

    def zeros(self) -> GradBuffer:
        return GradBuffer.zeros_like(self.live)

    def zero_(self) -> None:
        self._ddp.zero_grad_buffer()


class ForwardBackward:
    """Megatron's schedule over trajectories on one model chunk (module docstring)."""

    def __init__(self, ddp: DistributedDataParallel, pgs: ProcessGroups, options: PassOptions) -> None:
        self.ddp, self.pgs, self.options = ddp, pgs, options
        self._num_passes = 0

    @classmethod
    def build(cls, ddp: DistributedDataParallel, pgs: ProcessGroups, cfg: LearnerConfig,
              temperature: float) -> ForwardBackward:
        return cls(ddp, pgs, PassOptions.of(cfg, ddp, temperature, report=pgs.rank == 0))

    @property
    def num_passes(self) -> int:
        """Every trajectory's backward pass so far: the sum of what ``backward`` returned (module
        docstring: Pass counts)."""
        return self._num_passes

    def backward(self, trajs: Sequence[Trajectory], loss_fn: LossFn, router_weights: Sequence[float] | None = None,
                 *, need_entropy: bool = False, share_prefixes: bool = True) -> Passes:
        """Add the gradient of the sum of ``loss_fn`` over ``trajs`` into DDP's buffers (no
        data-parallel communication). ``router_weights``: each trajectory's weight of a MoE model's
        router losses (None: a call that trains none). ``share_prefixes=False``: one trajectory a
        row even where the options share prefixes. The reports hold zeros off the loss targets
        when the head reads only those (``loss_logits_only``)."""
        if not trajs:
            return Passes(0)
        opts = self.options
        with self.ddp.no_sync():
            reports = self._run(self.ddp, trajs, loss_fn, forward_only=False, need_entropy=need_entropy,
                                temperature=opts.temperature, router_weights=router_weights,
                                at_targets=opts.loss_logits_only, share=share_prefixes and opts.share_prefixes)
        self._num_passes += len(trajs)
        return Passes(len(trajs), reports)

    def backward_each(self, trajs: Sequence[Trajectory], loss_fn: LossFn, on_grad: Callable[[int], None],
                      router_weights: Sequence[float] | None = None, *, need_entropy: bool = False) -> Passes:
        """Each trajectory's gradient on its own, from one call (module docstring: Own gradients in
        one call): one trajectory a micro-batch, and ``on_grad(k)`` on this stage right after
        trajectory k's backward, with DDP's buffers holding its gradient alone; they are zeroed
        when ``on_grad`` returns. Not under context parallelism (each then takes a call)."""
        if not trajs:
            return Passes(0)
        if self.pgs.dims.cp > 1:
            reports: list[Report] = []
            for k, traj in enumerate(trajs):
                self.ddp.zero_grad_buffer()
                passes = self.backward([traj], partial(_as_item, loss_fn, k),
                                       None if router_weights is None else [router_weights[k]],
                                       need_entropy=need_entropy)
                on_grad(k)
                reports.extend(passes.reports)
            return Passes(len(trajs), reports)
        opts = self.options
        buffers = grad_data(self.ddp)

        def after(i: int) -> None:
            on_grad(i)
            for b in buffers:
                b.zero_()

        self.ddp.zero_grad_buffer()
        with self.ddp.no_sync(), _after_each_backward(after, len(trajs)):
            reports = self._run(self.ddp, trajs, loss_fn, forward_only=False, need_entropy=need_entropy,
                                temperature=opts.temperature, router_weights=router_weights,
                                at_targets=opts.loss_logits_only, share=False, one_each=True)
        self._num_passes += len(trajs)
        return Passes(len(trajs), reports)

    @torch.no_grad()
    def forward(self, trajs: Sequence[Trajectory], *, model: torch.nn.Module | None = None,
                temperature: float | None = None, need_entropy: bool = False) -> list[Report]:
        """Each trajectory's logprobs (and entropies) at every target, on the last stage (nothing
        elsewhere); of ``model`` (default the policy: e.g. the frozen reference) at ``temperature``
        (default the sampling temperature)."""
        if not trajs:
            return []
        return self._run(self.ddp if model is None else model, trajs, _no_loss, forward_only=True,
                         need_entropy=need_entropy,
                         temperature=self.options.temperature if temperature is None else temperature,
                         router_weights=None, at_targets=False, share=self.options.share_prefixes)

    def _run(self, model: torch.nn.Module, items: Sequence[Trajectory], loss_fn: LossFn, *, forward_only: bool,
             need_entropy: bool, temperature: float, router_weights: Sequence[float] | None, at_targets: bool,
             share: bool, one_each: bool = False) -> list[Report]:
        """One schedule call: the layout, the call, the reports back in ``items`` order.
        ``one_each``: one trajectory a micro-batch, in ``items`` order."""
        pgs = self.pgs
        replay = schedule_replay(model, items, pgs)  # learner.moe.routing_replay
        router_losses = schedule_router_losses(model, [t.tokens.numel() - 1 for t in items], router_weights, pgs)
        hooks = [h for h in (replay, router_losses) if h is not None]
        at_targets = at_targets and pgs.dims.cp == 1
        layout = (PackedRows(items, pgs.dims.seq_multiple, 0, at_targets, pgs.device) if one_each else
                  self._layout(items, at_targets=at_targets, share=share and (at_targets or forward_only) and not hooks))
        call = _Call(items, loss_fn, layout, hooks, HeadAtTargets.of(model, pgs) if layout.head_at_targets else None,
                     pgs, need_entropy, temperature)
        extra = {}
        if pgs.dims.pp > 1:
            config = model.config
            config.variable_seq_lengths = True  # every micro-batch its own [T_max, b] (shapes are sent first)
            extra["p2p_communicator"] = P2PCommunicator(pp_group=pgs.pp, config=config)
        try:
            out = get_forward_backward_func()(
                forward_step_func=call.forward_step, data_iterator=iter(range(len(layout.groups))), model=[model],
                num_microbatches=len(layout.groups), seq_length=layout.seq_length,
                micro_batch_size=layout.micro_batch_size, forward_only=forward_only, pg_collection=pgs.collection,
                **extra,
            )
        finally:
            for hook in hooks:
                hook.close()
        reports = [report for micro_batch in out for report in micro_batch]  # in the groups' order
        if not reports:  # not the last stage
            return reports
        in_order: list[Report] = [{}] * len(items)
        for k, report in zip((k for ks in layout.groups for k in ks), reports, strict=True):
            in_order[k] = report
        return in_order

    def _layout(self, items: Sequence[Trajectory], *, at_targets: bool, share: bool) -> Layout:
        """The call's micro-batch layout (``megathunder.learner.micro_batches``)."""
        dims, pack_tokens = self.pgs.dims, self.options.pack_tokens
        if dims.cp > 1:
            return ContextParallelRows(items, self.pgs)
        if share and pack_tokens > 0:
            shared = SharedPrefixRows.of(items, dims.seq_multiple, pack_tokens, scoring=not at_targets,
                                         device=self.pgs.device)
            if shared is not None:
                return shared
        return PackedRows(items, dims.seq_multiple, pack_tokens, at_targets, self.pgs.device)


@contextlib.contextmanager
def _after_each_backward(after: Callable[[int], None], num_micro_batches: int) -> Iterator[None]:
    """Within it, ``after(i)`` runs on this stage right after its i-th micro-batch backward of
    the schedule call (module docstring: Own gradients in one call)."""
    original = megatron_schedules.backward_step
    count = 0

    def backward_step(*args, **kwargs):
        nonlocal count
        grad = original(*args, **kwargs)
        after(count)
        count += 1
        return grad

    megatron_schedules.backward_step = backward_step
    try:
        yield
    finally:
        megatron_schedules.backward_step = original
    if count != num_micro_batches:
        raise RuntimeError(f"backward_each: the schedule ran {count} micro-batch backwards for {num_micro_batches} "
                           "trajectories (does this Megatron's schedule still call schedules.backward_step?)")


def _as_item(loss_fn: LossFn, k: int, _ks: Sequence[int], logp: torch.Tensor,
             entropy: torch.Tensor | None) -> torch.Tensor:
    """``loss_fn`` of trajectory k of a larger call, in a call of k alone."""
    return loss_fn([k], logp, entropy)


def _no_loss(_ks: Sequence[int], logp: torch.Tensor, _entropy: torch.Tensor | None) -> torch.Tensor:
    """Forward-only scoring's loss: nothing is trained."""
    return logp.sum() * 0


@dataclass
class _Call:
    """What one schedule call's forward steps and losses read."""

    items: Sequence[Trajectory]
    loss_fn: LossFn
    layout: Layout
    hooks: list[ScheduleReplay | ScheduleRouterLosses]  # set to each micro-batch's rows before its forward
    head: HeadAtTargets | None  # the head at the layout's targets; None: every position, or off the last stage
    pgs: ProcessGroups
    need_entropy: bool
    temperature: float

    def forward_step(self, data_iterator: Iterator[int], model: torch.nn.Module):
        """Megatron's ``forward_step_func``: micro-batch ``next(data_iterator)``'s forward, and its loss."""
        mb = self.layout.micro_batch(next(data_iterator))
        for hook in self.hooks:
            hook.set(mb.ks, mb.width)
        head = self.head
        select = (head.select(*mb.head, mb.inputs.shape[0]) if head is not None and mb.head is not None
                  else contextlib.nullcontext())
        with select, self.layout.forward_context(model, mb):
            output = model(mb.inputs, mb.positions, attention_mask=mb.mask)
        return output, partial(self.loss, mb)

    def loss(self, mb: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[Report]]:
        """``loss_fn`` of the micro-batch, and its trajectories' reports. ``output``: [b, W, v / tp]
        logits of every column, or [1, n, v / tp] of the head's targets in turn."""
        labels = mb.labels if mb.head is None else mb.labels[None]
        logps, entropies = vocab_parallel_logprobs(output, labels, self.pgs.tp, self.need_entropy, self.temperature)
        lengths = [self.items[k].tokens.shape[0] - 1 for k in mb.ks]
        if mb.head is not None:  # [1, n]: the head's targets already, in order
            logp_N, entropy_N = logps[0], None if entropies is None else entropies[0]
            logp_rows = to_rows(logp_N.detach(), mb.rows, mb.cols, lengths)
            entropy_rows = None if entropy_N is None else to_rows(entropy_N.detach(), mb.rows, mb.cols, lengths)
        else:  # [b, T]: every target of each row
            logps = self.layout.whole(logps)
            entropies = None if entropies is None else self.layout.whole(entropies)
            logp_N = logps[mb.rows, mb.cols]
            entropy_N = None if entropies is None else entropies[mb.rows, mb.cols]
            logp_rows = [logps[row, :n].detach() for row, n in enumerate(lengths)]
            entropy_rows = None if entropies is None else [entropies[row, :n].detach() for row, n in enumerate(lengths)]
        reports = [{"logp": logp} if entropy_rows is None else {"logp": logp, "entropy": entropy_rows[row]}
                   for row, logp in enumerate(logp_rows)]
        if mb.picks is not None:
            logp_N, entropy_N = logp_N[mb.picks], None if entropy_N is None else entropy_N[mb.picks]
        return self.loss_fn(mb.ks, logp_N, entropy_N), torch.ones((), dtype=torch.int, device=self.pgs.device), reports
