"""The learner side: per-trajectory cost, data-parallel ranks, pipeline bubbles, the update tail.

Cost of trajectory i (L_i context tokens) on one data-parallel replica (tp * pp GPUs):

    flops_i = f * (N * L_i + layers * hidden * L_i^2)        (f = 6: forward + backward, 8 with
                                                             full recomputation; the L^2 term:
                                                             causal attention's matmuls)
    work_i  = flops_i / (tp * pp * peak * MFU)               (or L_i * seconds_per_token, measured)

Trajectories are the microbatches. A rank that runs a *burst* of m microbatches through a p-stage
pipeline takes sum(work) * (m + p - 1) / m: bubble share (p - 1) / (m + p - 1). The batch-
synchronous learner runs the whole batch as one burst per rank (longest-first onto the least
loaded rank); a streaming learner runs a burst whenever work is ready, so a lone late trajectory
pays the full fill/drain.

After the last microbatch: the gradient reduce + optimizer step (o) and the weight push into the
engines (s). Without overlap they follow the last backward (b). With layer-by-layer overlap the
three form an L-stage pipeline over the layers (layer l's gradient is final once the last
backward has passed it): b, o, s cost (b + o + s) / L + (L - 1) / L * max(b, o, s) together.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from megathunder.simulate.profile import Profile
from megathunder.simulate.workload import Batch

BACKWARD_SHARE = 2.0 / 3.0  # backward ~ 2x forward


def trajectory_work_s(profile: Profile, batch: Batch) -> np.ndarray:
    """[B] forward+backward seconds of each trajectory on one data-parallel replica (as measured
    when the batch carries them: calibration's replay)."""
    if batch.work_s is not None:
        return batch.work_s
    lrn, m = profile.learner, profile.model
    L = batch.total_tokens.astype(float)
    if lrn.seconds_per_token is not None:
        return L * lrn.seconds_per_token
    flops = lrn.flops_per_param_token * (m.num_params * L + m.num_layers * m.hidden_size * L**2)
    replica = lrn.tensor_parallel * lrn.pipeline_parallel * profile.cluster.peak_flops_per_gpu
    return flops / (replica * lrn.mfu)


def burst_s(work_sum: float, m: int, p: int) -> float:
    return work_sum * (m + p - 1) / m


def update_tail_s(profile: Profile, last_backward_s: float) -> float:
    """Seconds from the end of the last microbatch to the weights being live in the engines."""
    lrn = profile.learner
    o, s = lrn.optimizer_step_s, lrn.weight_sync_s
    if not lrn.layerwise_overlap:
        return o + s
    b, L = last_backward_s, profile.model.num_layers
    return max(0.0, (b + o + s) / L + (L - 1) / L * max(b, o, s) - b)


@dataclass
class Burst:
    rank: int
    start: float
    end: float
    num_microbatches: int
    last_backward_s: float
    kind: str = "train"  # or "ledger": the learner blocked on a buffer operation


def train_batch(work: np.ndarray, num_ranks: int, p: int, t0: float) -> list[Burst]:
    """Batch-synchronous: the whole batch at t0, one burst per rank, longest-first balanced."""
    loads: list[list[float]] = [[] for _ in range(num_ranks)]
    heap = [(0.0, r) for r in range(num_ranks)]
    for w in np.sort(work)[::-1]:
        total, r = heapq.heappop(heap)
        loads[r].append(float(w))
        heapq.heappush(heap, (total + float(w), r))
    return [Burst(r, t0, t0 + burst_s(sum(ws), len(ws), p), len(ws), BACKWARD_SHARE * ws[-1])
            for r, ws in enumerate(loads) if ws]


def turn_items(batch: Batch, work: np.ndarray, turn_end: np.ndarray, finish: np.ndarray,
               strategy: str = "kv_adjoint") -> tuple[np.ndarray, np.ndarray]:
    """Per-turn score gradients (``ledger.per_turn_scores``): trajectory i's work split into one
    item per turn, in proportion to the turn's segment (the tool output before it and its
    generated tokens; the prompt too for the first), ready when the turn ends, and one item ready
    at its finish. kv_adjoint: each turn's item is its segment's forward and own-loss backward, the
    finish's the adjoint sweep, a backward (BACKWARD_SHARE) through every segment but the last --
    the items sum to more than ``work`` by it. forward_early: each turn's item is its segment's
    forward, the finish's the one backward of the whole trajectory -- they sum to ``work``.
    Returns (ready, work) per item."""
    starts = batch.turn_start
    before = np.concatenate([[0.0], batch.observation_tokens[:-1].astype(float)])  # o_{k-1} goes with turn k
    before[starts[:-1]] = batch.prompt_tokens  # a trajectory's first turn: its prompt
    seg = batch.decode_tokens + before
    share = seg / np.repeat(np.add.reduceat(seg, starts[:-1]), batch.num_turns)
    traj_of_turn = np.repeat(np.arange(batch.size), batch.num_turns)
    if strategy == "forward_early":
        per_turn, at_finish = (1.0 - BACKWARD_SHARE) * work[traj_of_turn] * share, BACKWARD_SHARE * work
    else:
        per_turn, at_finish = work[traj_of_turn] * share, BACKWARD_SHARE * work * (1.0 - share[starts[1:] - 1])
    return np.concatenate([turn_end, finish]), np.concatenate([per_turn, at_finish])
