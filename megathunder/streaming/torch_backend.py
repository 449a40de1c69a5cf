"""Gradient backend for a plain ``torch.nn.Module`` that maps tokens [B, L] to logits [B, L, V].

Every parameter's ``.grad`` is a view into one flat tensor, so a backward pass accumulates into
that storage in place (the way Megatron's ``main_grad`` buffers work) and the ledger can read it
as a ``GradBuffer`` without copies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from megathunder.config import RLObjective
from megathunder.objectives import LossSpec, token_logprobs_and_entropy, trajectory_loss
from megathunder.streaming.buffers import GradBuffer
from megathunder.trajectory import Trajectory


class TorchBackend:
    def __init__(self, model: nn.Module, objective: RLObjective) -> None:
        if not isinstance(objective, RLObjective):
            raise TypeError(f"TorchBackend: objective.kind={getattr(objective, 'kind', type(objective).__name__)} has "
                            "no reward part; it computes the losses of an RLObjective (GRPO and its variants)")
        self.model = model
        self.objective = objective
        self.params = [p for p in model.parameters() if p.requires_grad]
        if len({p.dtype for p in self.params}) != 1:
            raise ValueError("TorchBackend: all trainable parameters must share one dtype")
        self._flat = torch.zeros(sum(p.numel() for p in self.params), dtype=self.params[0].dtype)
        offset = 0
        for p in self.params:
            p.grad = self._flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.live = GradBuffer([self._flat])
        self.num_backward = 0
        self.num_forward = 0

    def zeros(self) -> GradBuffer:
        return GradBuffer([torch.zeros_like(self._flat)])

    def backward(self, traj: Trajectory, specs: Sequence[LossSpec]) -> Iterator[GradBuffer]:
        logits = self.model(traj.tokens.unsqueeze(0))[0, :-1]
        self.num_forward += 1
        logp, entropy = token_logprobs_and_entropy(
            logits, traj.tokens[1:], need_entropy=self.objective.entropy_coef > 0
        )
        for k, spec in enumerate(specs):
            loss = trajectory_loss(logp, entropy, traj, spec, self.objective)
            self._flat.zero_()
            loss.backward(retain_graph=k + 1 < len(specs))
            self.num_backward += 1
            self._check_grads_in_place()
            yield self.live

    def backward_each(self, items: Sequence[tuple[Trajectory, Sequence[LossSpec]]],
                      on_grad: Callable[[int, int, GradBuffer], None]) -> None:
        """Every trajectory's gradients on their own, as ``backward`` gives them, one trajectory
        after another (the ledger's packed path; on Megatron one pipelined call)."""
        for k, (traj, specs) in enumerate(items):
            for j, grad in enumerate(self.backward(traj, specs)):
                on_grad(k, j, grad)

    def load_grad(self, grad: GradBuffer) -> None:
        self.live.copy_(grad)

    def _check_grads_in_place(self) -> None:
        for p in self.params:
            if p.grad is None or p.grad.untyped_storage().data_ptr() != self._flat.untyped_storage().data_ptr():
                raise RuntimeError("a parameter's .grad left the flat gradient storage")
