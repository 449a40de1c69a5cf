"""Per-turn GRPO score gradients: each finished model turn's part of h_i while its tool call runs.

Why it is exact
---------------
The ledger streams ``grad L = (1/Z) sum_i (-A_i h_i + keep_g q_i)`` with h_i = grad loss_i(A = -1)
(``megathunder.streaming.ledger``). At ratio 1 every surrogate's per-token gradient is -A grad l_t
(``megathunder.objectives.policy_loss``), so with no importance weights (``objective.tis: none``) and
a per-trajectory weight nu_i = 1 (every ``loss_agg`` but seq_mean_token_mean)

    h_i = sum_{t in m_i} grad l_t = sum_k grad L_k,        L_k = sum_{t in turn k} l_t

(l_t the log-probability of target t at the run's temperature, m_i the trajectory's loss mask). L_k
depends on the weights through turn k's tokens and every earlier one, and is fixed the moment
turn k is generated: there is one optimizer step per batch. So each grad L_k can be computed when
turn k ends, while its tool call runs, by any of the per-turn strategies OPD uses
(``megathunder.streaming.opd_turns.TurnStreamer``: recompute, kv_adjoint's own-loss backward now and
one adjoint sweep at the end, forward_early), and summed into the trajectory's pending buffer. At
its finish the buffer holds h_i, the ledger treats it as a pending gradient computed at finish, and
its reward folds it in with the same coefficient the reward-time backward would have had
(``GradientLedger.begin_turns`` / ``turn_buffer`` / ``drop_turns``). The sum is reassociated, nothing
else: in fp64 to 1e-10, not bitwise.

What the turns cover is checked, not assumed: at finish the turns streamed must be exactly the
trajectory's effective loss mask (a truncated trajectory under ``overlong_filter`` has none; an
engine that closed a turn with a masked token is fine, since its turn span never held it). If they
are not, the buffer is given back and h_i comes from the finish-time path, so a mismatch costs time,
never the update. A trajectory that found no pending buffer free at its first turn, or whose group
was dropped meanwhile (a failed groupmate), is not streamed further.

The reward-free terms q_i (KL, entropy) are not split by turn: the ledger runs them in a pass of
their own once the group is known kept, as it does for any pending h_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megathunder.config import RLObjective
from megathunder.objectives.dapo import effective_loss_mask
from megathunder.streaming.buffers import BufferPool, GradBuffer
from megathunder.streaming.ledger import GradientLedger
from megathunder.streaming.opd_grpo import IntoAccumulator
from megathunder.streaming.opd_turns import SegmentModel, Strategy, TurnStreamer
from megathunder.trajectory import Trajectory


def check_streamable(objective: RLObjective) -> None:
    """Raise unless h_i is a plain sum of per-token log-probability gradients (module docstring)."""
    if objective.tis != "none":
        raise ValueError(f"per-turn score gradients: objective.tis {objective.tis} needs the engine's logprobs")
    if objective.loss_agg == "seq_mean_token_mean":
        raise ValueError("per-turn score gradients: loss_agg seq_mean_token_mean weights by 1 / the length")
    if objective.needs_old_logprobs:
        raise ValueError("per-turn score gradients: PPO epochs move the ratio off 1")


class _NoTeacher:
    """GRPO's turns have no teacher; the streamer's turn loss below never asks one."""

    def score(self, traj_id: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        raise AssertionError("internal: the score turn loss asked for a teacher")

    def release(self, traj_id: int) -> None:
        pass


class _ScoreStreamer(TurnStreamer):
    """The per-turn strategies with turn k's loss L_k = sum of its targets' log-probabilities."""

    def _turn_loss(self, traj_id: int, all_tokens: torch.Tensor, start: int,
                   logits_for_targets: torch.Tensor) -> torch.Tensor:
        return self.model.logprobs(logits_for_targets, all_tokens[start:]).sum()


class _IntoPending(IntoAccumulator):
    """Each backward pass moved from the live storage into the current trajectory's pending buffer
    (through the pool: the slots' dtype and placement)."""

    def __init__(self, inner: SegmentModel, live: GradBuffer, pool: BufferPool) -> None:
        super().__init__(inner, live, live)
        self.pool = pool
        self.target: GradBuffer | None = None

    def backward(self, outputs, grads, retain_graph=False):
        assert self.target is not None, "internal: a turn backward with no pending buffer"
        self.live.zero_()
        self.inner.backward(outputs, grads, retain_graph)
        self.pool.slot_write(self.target, self.live)


@dataclass
class _Fed:
    end: int  # tokens of the trajectory given to the streamer so far
    spans: list[tuple[int, int]]  # [start, end) of each streamed turn


class ScoreTurns:
    """Events, on the rank that owns the trajectory: ``on_turn(traj_id, tokens, start, end)`` (turn
    ``tokens[start:end]`` was generated, ``tokens`` the trajectory so far), then ``on_finished(traj)``
    just before ``GradientLedger.on_finished(traj)``."""

    def __init__(self, ledger: GradientLedger, segment_model: SegmentModel, live: GradBuffer,
                 strategy: Strategy = "kv_adjoint", max_cached: int | None = None) -> None:
        check_streamable(ledger.objective)
        self.ledger = ledger
        self.objective = ledger.objective
        self._into = _IntoPending(segment_model, live, ledger.pool)
        self.streamer = _ScoreStreamer(self._into, _NoTeacher(), strategy=strategy, max_cached=max_cached)
        self._fed: dict[int, _Fed] = {}
        self._declined: set[int] = set()  # no buffer at the first turn, or its group dropped

    def on_turn(self, traj_id: int, tokens: list[int], start: int, end: int) -> None:
        if start == end or traj_id in self._declined:
            return
        fed = self._fed.get(traj_id)
        if fed is None:
            buf = self.ledger.begin_turns(traj_id)
            if buf is None:
                self._declined.add(traj_id)
                return
            self.streamer.begin_trajectory(traj_id, tokens[:start])
            fed = self._fed[traj_id] = _Fed(end=start, spans=[])
        else:
            buf = self.ledger.turn_buffer(traj_id)
            if buf is None:  # its group was dropped: its turns are worth nothing
                self._abandon(traj_id)
                return
            self.streamer.on_tool_output(traj_id, tokens[fed.end : start])  # context only
        self._into.target = buf
        self.streamer.on_turn(traj_id, tokens[start:end])
        fed.end = end
        fed.spans.append((start, end))

    def on_finished(self, traj: Trajectory) -> None:
        """Finish the trajectory's h_i (kv_adjoint: the reverse sweep), or give its buffer back
        when the turns streamed are not its loss mask."""
        tid = traj.traj_id
        fed = self._fed.get(tid)
        self._declined.discard(tid)
        if fed is None:
            return
        buf = self.ledger.turn_buffer(tid)
        if buf is None or not _spans_are_mask(fed.spans, effective_loss_mask(traj, self.objective.overlong_filter)):
            self._abandon(tid)
            if buf is not None:
                self.ledger.drop_turns(tid)
            return
        self._into.target = buf
        self.streamer.end_trajectory(tid)
        self.streamer.reset_counts()
        del self._fed[tid]

    def _abandon(self, traj_id: int) -> None:
        """Forget a trajectory's streamed state (K/V, graphs) without its sweep."""
        self._fed.pop(traj_id, None)
        self.streamer.drop_trajectory(traj_id)
        self._declined.add(traj_id)

    @property
    def stats(self) -> dict[str, int]:
        return self.streamer.stats


def _spans_are_mask(spans: list[tuple[int, int]], mask: torch.Tensor) -> bool:
    """Do the turns' token spans [start, end) cover exactly the targets of ``mask`` (target t is
    token t + 1)?"""
    streamed = torch.zeros_like(mask)
    for start, end in spans:
        streamed[start - 1 : end - 1] = True
    return bool(torch.equal(streamed, mask))
