"""The gradient ledger's backend on Megatron: the ledger's passes are calls of the learner's one
forward-backward (``megathunder.learner.forward_backward``), accumulating into DDP's gradient buffers.

The "live" gradient storage the ledger reads is ``DistributedDataParallel.buffers[*].grad_data``
-- the flat buffers every parameter's ``main_grad`` is a view of (``GradientSpace``). A backward
for the ledger runs inside ``no_sync`` (no data-parallel communication per trajectory), after
``zero_grad_buffer``; the ledger copies or adds the result into its own accumulators. At batch close
the final gradient is written back into ``grad_data`` and reduced across data-parallel ranks once.

All ranks of one model-parallel group (TP and PP peers) must call ``backward`` with the same
trajectories in the same order: the schedule communicates between them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from megathunder.config import RLObjective
from megathunder.learner.forward_backward import ForwardBackward, GradientSpace, LossFn
from megathunder.objectives import LossSpec, router_loss_weight, trajectories_loss
from megathunder.streaming.buffers import GradBuffer
from megathunder.trajectory import Trajectory


class MegatronBackend:
    """``GradientBackend`` over the learner's ``ForwardBackward``: each backward a schedule call of
    the objective's loss (``objectives.trajectories_loss``) into the zeroed ``GradientSpace``."""

    def __init__(self, passes: ForwardBackward, gradients: GradientSpace, objective: RLObjective | None,
                 router_losses: bool = False) -> None:
        self.passes = passes
        self.gradients = gradients
        self.live = gradients.live
        self.objective = objective
        self.router_losses = router_losses  # learner.moe: a reward-free pass adds the routers' losses

    def zeros(self) -> GradBuffer:
        return self.gradients.zeros()

    def _objective(self) -> RLObjective:
        if self.objective is None:
            raise TypeError("this learner's objective has no reward part (objective.kind=opd)")
        return self.objective

    def backward(self, traj: Trajectory, specs: Sequence[LossSpec]) -> Iterator[GradBuffer]:
        # One schedule call per spec: a pipeline schedule runs exactly one backward per forward.
        for spec in specs:
            self.backward_sum([traj], [spec])
            yield self.live

    def backward_each(self, items: Sequence[tuple[Trajectory, Sequence[LossSpec]]],
                      on_grad: Callable[[int, int, GradBuffer], None]) -> None:
        """Every (trajectory k, its j-th spec) gradient on its own, from one schedule call (pipelined
        under PP: ``ForwardBackward.backward_each``): ``on_grad(k, j, live)`` right after that
        micro-batch's backward on this stage, ``live`` holding its gradient alone. Element for element
        what ``backward`` gives for each."""
        objective = self._objective()
        flat = [(k, j, traj, spec) for k, (traj, specs) in enumerate(items) for j, spec in enumerate(specs)]
        trajs, specs = [f[2] for f in flat], [f[3] for f in flat]

        def after(i: int) -> None:  # micro-batch i: trajectory k's j-th pass
            on_grad(flat[i][0], flat[i][1], self.live)

        self.passes.backward_each(trajs, self._loss(trajs, specs, None), after, self._router_weights(trajs, specs),
                                  need_entropy=objective.entropy_coef > 0)

    def backward_sum(self, trajs: Sequence[Trajectory], specs: Sequence[LossSpec],
                     old: Sequence[torch.Tensor | None] | None = None) -> GradBuffer:
        """Sum of several trajectories' gradients from one schedule call (pipelined under PP), packed
        into micro-batches of at most ``learner.pack_tokens`` tokens. ``old``: each trajectory's
        PPO old logprobs (None: the current ones, ratio 1)."""
        objective = self._objective()
        self.gradients.zero_()
        self.passes.backward(trajs, self._loss(trajs, specs, old), self._router_weights(trajs, specs),
                             need_entropy=objective.entropy_coef > 0)
        return self.live

    def _loss(self, trajs: Sequence[Trajectory], specs: Sequence[LossSpec],
              old: Sequence[torch.Tensor | None] | None) -> LossFn:
        objective = self._objective()

        def loss(ks: Sequence[int], logp: torch.Tensor, ent: torch.Tensor | None) -> torch.Tensor:
            return trajectories_loss(logp, ent, [trajs[k] for k in ks], [specs[k] for k in ks], objective,
                                     None if old is None else [old[k] for k in ks])
        return loss

    def _router_weights(self, trajs: Sequence[Trajectory], specs: Sequence[LossSpec]) -> list[float] | None:
        if not self.router_losses:
            return None
        objective = self._objective()
        return [router_loss_weight(t, s, objective) for t, s in zip(trajs, specs, strict=True)]

    def load_grad(self, grad: GradBuffer) -> None:
        self.live.copy_(grad)

