"""One batch's gradient, from the events of its trajectories: streamed (thunder) or at the end.

Both paths leave ``(1/Z) sum_i grad loss_i`` in the learner's gradient buffers and differ only in
*when* the work happens: ``streamed`` hands each finished trajectory and each reward to the
gradient ledger the moment it arrives; ``at_end`` keeps them and runs the batch-synchronous
gradient after the last reward. ``megathunder.streaming.ledger`` derives why the two are equal.

Data parallelism: each finished trajectory is owned by the DP rank with the fewest loss tokens so
far (ties to the lowest rank). The choice depends only on the order of finish events, which every
rank sees identically, so ranks agree without talking; TP/PP peers share the DP rank and so
receive the same trajectories in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

from megathunder.trajectory import Trajectory


class TokenBalancer:
    def __init__(self, dp: int) -> None:
        self.load = [0] * dp

    def assign(self, num_tokens: int) -> int:
        rank = min(range(len(self.load)), key=lambda r: (self.load[r], r))
        self.load[rank] += num_tokens
        return rank


@dataclass
class BatchOutcome:
    num_kept_groups: int
    num_dropped_groups: int
    num_kept_trajectories: int
    peak_buffers: int
    backward_after_last_reward: int  # learner passes left when the batch's last reward arrived
    divergence: float | None = None  # OPD: the student's mean per-token divergence to the teacher


class BatchGradient:
    """Accumulates one batch on one learner rank; ``streamed`` selects the thunder path."""

    def __init__(self, learner, plan: list[tuple[int, list[int]]], streamed: bool) -> None:
        self.learner, self.plan, self.streamed = learner, plan, streamed
        self.balancer = TokenBalancer(learner.groups.dims.dp)
        self.group_of = {tid: g for g, members in plan for tid in members}
        self.owner: dict[int, int] = {}
        self.trajs: dict[int, Trajectory] = {}
        self.rewards: dict[int, float] = {}
        self.dropped: set[int] = set()  # groups excluded (a failed trajectory)
        self._passes_at_last_reward = 0
        learner.backend.num_backward = 0
        if streamed:
            learner.ledger.begin_batch(plan)

    @property
    def _mine(self) -> int:
        return self.learner.groups.dp_rank

    def on_finished(self, traj: Trajectory) -> None:
        n = self.learner.num_loss_tokens(traj)
        owner = self.owner[traj.traj_id] = self.balancer.assign(n)
        if owner == self._mine:
            if self.learner.reference is not None:
                self.learner.fill_ref_logprobs([traj])
            self.trajs[traj.traj_id] = traj
        if self.streamed:
            if owner == self._mine:
                self.learner.ledger.on_finished(traj)
            else:
                self.learner.ledger.on_remote_finished(traj.traj_id, n)
        elif owner != self._mine:
            self.trajs[traj.traj_id] = traj  # the batch path needs every trajectory's size

    def on_reward(self, traj_id: int, reward: float | None) -> None:
        """``None``: the trajectory failed (verifier policy drop_group); its group leaves the batch."""
        self._passes_at_last_reward = self.learner.backend.num_backward
        if reward is None:
            self.dropped.add(self.group_of[traj_id])
        if self.streamed:
            self.learner.ledger.on_reward(traj_id, reward)
        self.rewards[traj_id] = reward

    def close(self) -> BatchOutcome:
        if self.streamed:
            result = self.learner.ledger.close_batch()
            kept, dropped = result.num_kept_groups, result.num_dropped_groups
            num_kept, peak = result.num_kept_trajectories, result.peak_buffers
        else:
            order = [tid for g, members in self.plan if g not in self.dropped for tid in members]
            batch = [self.trajs[t] for t in order]
            rewards = [self.rewards[t] for t in order]
            owner = [self.owner[t] for t in order]
            self.learner.sync_step_gradient(batch, rewards, owner)
            kept = len(self.plan) - len(self.dropped)
            dropped, num_kept, peak = len(self.dropped), len(batch), 1
        total = self.learner.backend.num_backward
        return BatchOutcome(kept, dropped, num_kept, peak, total - self._passes_at_last_reward)
