"""Routing replay in the learner: every MoE layer uses the experts the rollout engine routed each
token to (``learner.moe.routing_replay``), with Megatron's own ``RouterReplay``.

Why. A MoE layer's output is discontinuous in its router logits: where two experts' logits are
near-tied, the learner's and the engine's kernels (different GEMMs, dtypes, reduction orders) can
pick different experts for the same token, and then the learner differentiates a policy that did
not produce the sample -- the "on-policy" gradient is not (Megatron-LM#4168). Replaying the
engine's top-k ids makes the learner's forward the forward of the sampled policy up to the smooth
rounding differences of the rest of the network. The gate weights stay differentiable: Megatron
gathers the router's scores at the replayed ids (``scores.gather(1, ids)``) and normalises them as
it would its own top-k, so the router still gets the gradient of the experts it weights.

Exactness is unchanged. Replay fixes a discrete choice per token; given that choice the loss is
the same smooth function of the parameters in the streamed and the batch-synchronous update, and
both replay the same ids for the same trajectory (they travel with it, into the journal too).

Layout. The engine's rows are per input position (``Trajectory.routed_experts``: [T - 1, layers,
top_k], layer = the global 0-based layer index, which is Megatron's 1-based ``layer_number`` - 1,
PP offset included). A packed micro-batch is [b, width] tokens; Megatron's hidden states are
sequence-first, and a router flattens its input [s, b, h] into rows s * b + j, so the replayed
ids are laid out [width, b, top_k], each row's pad positions given experts 0..top_k-1 (pads reach
no real position: attention is causal and their targets are cut before the loss). Under sequence
parallelism a TP rank routes only its own slice of the sequence, [r * width / tp, (r + 1) * width
/ tp). Context parallelism is refused (``LearnerConfig``), and so is recomputation that would
run a router again in the backward: the schedule sets each micro-batch's ids just before its
forward, and the backward of a non-recomputed MoE layer never consults the router again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


from megathunder.learner.parallel import ProcessGroups
from megathunder.trajectory import Trajectory


def replay_routers(model: torch.nn.Module) -> list[tuple[int, RouterReplay]]:
    """(global 0-based layer, its ``RouterReplay``) for this rank's MoE layers, in model order;
    empty when the model was built without ``moe_enable_routing_replay``."""
    return [(m.layer_number - 1, m.router_replay) for m in model.modules()
            if isinstance(m, TopKRouter) and m.router_replay is not None]


class ScheduleReplay:
    """Replays ``items``' engine routing for one schedule call: ``set(ks, width)`` before each
    micro-batch's forward, ``close()`` after the call."""

    def __init__(self, routers: list[tuple[int, RouterReplay]], items: Sequence[Trajectory], pgs: ProcessGroups) -> None:
        for t in items:
            if t.routed_experts is None:
                raise ValueError(f"routing replay: trajectory {t.traj_id} has no routed experts (the others do)")
            missing = int((t.routed_experts < 0).any(dim=(1, 2)).sum())
            if missing:
                raise ValueError(f"routing replay: trajectory {t.traj_id} lacks the engine's routing for {missing} "
                                 f"of its {t.num_targets} input positions (the engine never computed them under "
                                 "the weights that sampled it)")
        self.routers, self.items, self.pgs = routers, items, pgs
        for _, replay in routers:
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def set(self, ks: Sequence[int], width: int) -> None:
        first = self.items[ks[0]].routed_experts
        assert first is not None
        num_layers, top_k = first.shape[1:]
        ids = torch.arange(top_k).repeat(width, len(ks), num_layers, 1)  # [width, rows, layers, k]; pads: any
        for row, k in enumerate(ks):
            rows = self.items[k].routed_experts
            assert rows is not None
            ids[: rows.shape[0], row] = rows.to(torch.int64)
        dims = self.pgs.dims
        if dims.sp and dims.tp > 1:  # this TP rank routes its slice of the sequence
            local = width // dims.tp
            rank = torch.distributed.get_rank(self.pgs.tp)
            ids = ids[rank * local : (rank + 1) * local]
        ids = ids.to(self.pgs.device)
        for layer, replay in self.routers:
            replay.set_target_indices(ids[:, :, layer].reshape(-1, top_k))

    def close(self) -> None:
        for _, replay in self.routers:
            replay.clear_indices()
            replay.clear_router_replay_action()


def schedule_replay(model: torch.nn.Module, items: Sequence[Trajectory], pgs: ProcessGroups) -> ScheduleReplay | None:
    """A replay for this schedule call when the model replays and the trajectories carry the
    engine's routing; None otherwise (the model routes by itself: SFT, probes of prompts, a
    reference model)."""
    if all(t.routed_experts is None for t in items) or not getattr(
            getattr(model, "config", None), "moe_enable_routing_replay", False):
        return None  # checked before walking the model's modules: every schedule call asks
    routers = replay_routers(model)
    if not routers:
        return None
    return ScheduleReplay(routers, items, pgs)

