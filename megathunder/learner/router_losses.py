"""MoE router losses under the gradient ledger: Megatron's per-sequence load-balancing loss
(``seq_aux_loss``) and the router z-loss, each trajectory's own, entering only the ledger's
reward-free backward passes (``learner.moe.aux_loss_coeff`` / ``z_loss_coeff``).

The batch objective. For trajectory i with n_i input positions (its tokens but the last: every
position a router sees), E experts, top-k routing, router scores p_te (softmax over all experts)
and c_te = 1 if expert e is among t's k largest scores:

    aux_i = a * E / (k n_i^2) * sum_e (sum_{t<n_i} p_te) (sum_{t<n_i} c_te)      (Switch / seq_aux_loss)
    z_i   = z * (1 / n_i) * sum_{t<n_i} logsumexp(logits_t)^2                      (ST-MoE z-loss)

summed over the MoE layers, with a = ``aux_loss_coeff`` and z = ``z_loss_coeff``. Both are functions
of trajectory i's tokens and the weights alone (the routers of one sequence; under replay the
gate scores still are the router's own). The batch loss adds them as if each were spread evenly
over the trajectory's loss tokens, exactly as the KL term is weighted (``megathunder.objectives``):

    L = (1/Z) * sum_i [ loss_i(A_i, rf = 1) + w_i (aux_i + z_i) ],   w_i = nu_i * m_i

(m_i: its loss tokens, nu_i: the aggregation's sequence weight, Z: the batch normaliser). So under
``seq_mean_token_mean`` (nu_i = 1 / m_i, Z = sequences) the router losses are the mean over the
batch's sequences -- what Megatron's own schedule gives with one sequence per micro-batch -- and
under ``token_mean`` (nu_i = 1, Z = loss tokens) the mean weighted by loss tokens, as Megatron's
``calculate_per_token_loss`` weights them by tokens. A trajectory without loss tokens adds nothing,
like its KL term.

Why the streamed sum is the batch gradient. Each term w_i (aux_i + z_i) is reward-free and of
trajectory i alone, so it is a part of q_i (``megathunder.streaming.ledger``: grad L = (1/Z) sum_i
(-A_i h_i + keep_g q_i)): it enters exactly the passes q_i enters -- a reward-free pass
(``LossSpec.reward_free``: fused with the score once the group has closed, or alone at finish),
never a score-only pass (h_i, slots), and only for kept groups -- and the one division by Z at
batch close normalises it as the reference does. What has to hold is that the term a pass adds
depends on nothing but its trajectory: not on the other rows of its micro-batch, their padding,
the number of micro-batches or the schedule. Megatron's own ``_apply_seq_aux_loss`` does not give
that for a packed micro-batch: it divides every row by the micro-batch's mean length (with a
padding mask) or its padded width (without), averages over the rows and is scaled by the schedule
(1 / micro-batches, or the micro-batch's token count under ``calculate_per_token_loss``); its z-loss
is the micro-batch's token mean, split evenly over the TP ranks. So ``LedgerRouter`` overrides the
two: for each row b of a micro-batch it counts c over that row's real positions only (pads masked:
the row's own n_b, never the width), all-reduced over the TP group under sequence parallelism (each
rank routes its slice [r s / TP, (r + 1) s / TP) of the sequence), sums its scores over its own
real positions, and calls Megatron's ``switch_load_balancing_loss_func`` with total tokens n_b --
one sequence's loss, with the row's weight w_b (the pass's, 0 in a score-only pass); the z-loss
likewise sums each row's real positions and divides by its n_b. The weighted sum is attached with
Megatron's ``MoEAuxLossAutoScaler``, whose backward scale the schedule sets to 1 under
``calculate_per_token_loss`` (the main loss's scale: ``megatron.core.pipeline_parallel.schedules``),
so each pass adds exactly w_b grad(aux_b + z_b) on top of its loss's gradient. The weights are
taken when the micro-batch's forward runs (``set`` before each forward) and live in the attached
tensor, so a pipeline schedule that runs other forwards before this backward changes nothing.

Padding: a pad position's router output carries no loss (masked above) and, attention being causal,
its hidden state reaches no real position; without the mask a packed row would count its pads as
tokens routed, a different loss. Layouts: the TP peers of a row each sum their own positions and
the all-reduced counts are the row's, so their terms add to the row's term; EP changes where the
experts run, not the router; DP ranks train disjoint trajectories and ``step`` sums them; PP
stages hold their own layers' routers. Not carried (refused by field, ``MoEConfig`` /
``LearnerConfig``): Megatron's micro-batch ``aux_loss`` and ``global_aux_loss`` (they couple the
tokens of a micro-batch / the whole batch: no per-trajectory decomposition), context parallelism,
and recomputation that reruns the router in the backward (the micro-batch's weights are gone then).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, switch_load_balancing_loss_func
from megatron.core.transformer.moe.router import TopKRouter

from megathunder.learner.parallel import ProcessGroups


class RouterRows:
    """One micro-batch's rows as this rank's routers see them: the weight of each row's router
    losses, its real positions on this rank's slice of the sequence, and its length."""

    def __init__(self, weights: Sequence[float], lengths: Sequence[int], width: int, pgs: ProcessGroups) -> None:
        device = pgs.device
        self.weights = [float(w) for w in weights]
        self.lengths = [int(n) for n in lengths]
        positions = torch.arange(width, device=device)
        dims = pgs.dims
        if dims.sp and dims.tp > 1:  # this TP rank routes its slice of the sequence
            local = width // dims.tp
            rank = torch.distributed.get_rank(pgs.tp)
            positions = positions[rank * local: (rank + 1) * local]
        self.valid = positions[:, None] < torch.tensor(self.lengths, device=device)[None, :]  # [s_local, b]

    @property
    def any_weight(self) -> bool:
        return any(w != 0.0 for w in self.weights)


class LedgerRouter(TopKRouter):
    """Megatron's ``TopKRouter`` whose ``seq_aux_loss`` and z-loss are per trajectory and weighted
    per row (module docstring); the routing itself is the parent's."""

    rows: RouterRows | None = None  # set by ``ScheduleRouterLosses`` before each micro-batch's forward

    def _current_rows(self) -> RouterRows:
        if self.rows is None:
            raise RuntimeError("learner.moe.aux_loss_coeff / z_loss_coeff: a training forward outside the GRPO "
                               "learner's schedule (router losses are trained only as the ledger's reward-free "
                               "terms); set them to 0 for this use")
        return self.rows

    def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz, with_padding_mask=False):
        coeff = self.get_aux_loss_coeff("seq_aux_loss")
        if coeff == 0:
            return probs
        rows = self._current_rows()
        if not rows.any_weight:  # a score-only pass: no router loss
            return probs
        experts = self.config.num_moe_experts
        valid = rows.valid.reshape(seq_length, bsz, 1)
        scores = scores_for_aux_loss.reshape(seq_length, bsz, experts) * valid
        chosen = routing_map.reshape(seq_length, bsz, experts) & valid
        # each row's tokens per expert over the whole sequence (SP: the TP ranks' slices summed)
        counts = reduce_from_tensor_model_parallel_region(chosen.sum(dim=0), self.tp_cp_group)  # [b, E]
        total = scores.new_zeros(())
        for b, (w, n) in enumerate(zip(rows.weights, rows.lengths, strict=True)):
            if w == 0.0 or n == 0:
                continue
            aux = switch_load_balancing_loss_func(probs=scores[:, b], tokens_per_expert=counts[b], total_num_tokens=n,
                                                  topk=self.topk, num_experts=experts, moe_aux_loss_coeff=coeff)
            total = total + w * aux
        return MoEAuxLossAutoScaler.apply(probs, total)

    def apply_z_loss(self, logits, padding_mask=None):
        coeff = self.config.moe_z_loss_coeff
        if coeff is None or coeff == 0 or not (self.training and torch.is_grad_enabled()):
            return logits
        rows = self._current_rows()
        if not rows.any_weight:
            return logits
        seq_length, bsz = rows.valid.shape
        z = torch.logsumexp(logits.float(), dim=-1).square().reshape(seq_length, bsz)  # Megatron's z_loss_func terms
        per_row = torch.where(rows.valid, z, 0.0).sum(dim=0)  # [b], this rank's positions
        scale = torch.tensor([w / n if n else 0.0 for w, n in zip(rows.weights, rows.lengths, strict=True)],
                             dtype=per_row.dtype, device=per_row.device)
        return MoEAuxLossAutoScaler.apply(logits, coeff * (per_row * scale).sum())


class ScheduleRouterLosses:
    """The router-loss weights of one schedule call: ``set(ks, width)`` before each micro-batch's
    forward, ``close()`` after the call."""

    def __init__(self, routers: list[LedgerRouter], lengths: Sequence[int], weights: Sequence[float] | None,
                 pgs: ProcessGroups) -> None:
        self.routers, self.lengths, self.weights, self.pgs = routers, lengths, weights, pgs

    def set(self, ks: Sequence[int], width: int) -> None:
        if self.weights is None:  # no weights given: a use the router losses are not defined for
            for r in self.routers:
                r.rows = None
            return
        rows = RouterRows([self.weights[k] for k in ks], [self.lengths[k] for k in ks], width, self.pgs)
        for r in self.routers:
            r.rows = rows

    def close(self) -> None:
        for r in self.routers:
            r.rows = None


def has_router_losses(config: object) -> bool:
    """Whether a model built from this ``TransformerConfig`` trains router losses (LedgerRouter)."""
    return bool(getattr(config, "num_moe_experts", None)) and (
        (getattr(config, "moe_router_load_balancing_type", "none") == "seq_aux_loss"
         and float(getattr(config, "moe_aux_loss_coeff", 0.0) or 0.0) > 0)
        or float(getattr(config, "moe_z_loss_coeff", 0.0) or 0.0) > 0)


def schedule_router_losses(model: torch.nn.Module, lengths: Sequence[int], weights: Sequence[float] | None,
                           pgs: ProcessGroups) -> ScheduleRouterLosses | None:
    """The router-loss weights of a schedule call when the model trains router losses, else None
    (checked from the config before walking the model's modules)."""
    if not has_router_losses(getattr(model, "config", None)):
        return None
    routers = [m for m in model.modules() if isinstance(m, LedgerRouter)]
    return ScheduleRouterLosses(routers, lengths, weights, pgs) if routers else None
