"""Per-turn GRPO score gradients: each finished model turn's part of h_i while its tool call runs.

Why it is exact
---------------
The ledger streams ``grad L = (1/Z) sum_i (-A_i h_i + keep_g q_i)`` with h_i = grad loss_i(A = -1)
(``megathunder.streaming.ledger``). At ratio 1 every surrogate's per-token gradient is -A grad l_t
(``megathunder.objectives.policy_loss``), so with a per-trajectory weight nu_i = 1 (every
``loss_agg`` but seq_mean_token_mean)

    h_i = sum_{t in m_i} w_t grad l_t = sum_k grad L_k,        L_k = sum_{t in turn k} w_t l_t

(l_t the log-probability of target t at the run's temperature, m_i the trajectory's loss mask, w_t
the detached per-token TIS weight min(exp(l_t - l^engine_t), cap) of ``objective.tis: token``, or 1
with ``tis: none``; sequence TIS weighs by the whole trajectory and is not streamed by turns). L_k
depends on the weights through turn k's tokens and every earlier one, and is fixed the moment
turn k is generated (its engine logprobs come with the turn event): there is one optimizer step
per batch. So each grad L_k can be computed when
turn k ends, while its tool call runs, by any of the per-turn strategies OPD uses
(``megathunder.streaming.opd_turns.TurnStreamer``: recompute, kv_adjoint's own-loss backward now and
one adjoint sweep at the end, forward_early), and summed into the trajectory's pending buffer. At
its finish the buffer holds h_i, the ledger treats it as a pending gradient computed at finish, and
its reward folds it in with the same coefficient the reward-time backward would have had
(``GradientLedger.begin_turns`` / ``turn_buffer`` / ``drop_turns``). The sum is reassociated, nothing
else: in fp64 to 1e-10, not bitwise.

What the turns cover is checked, not assumed: at finish the turns streamed must be exactly the
trajectory's effective loss mask (a truncated trajectory under ``overlong_filter`` has none; an
engine that closed a turn with a masked token is fine, since its turn span never held it), and
under TIS the engine logprobs the turns used must be the trajectory's, bit for bit. If not, the buffer is given back and h_i comes from the finish-time path, so a mismatch costs time,
never the update. A trajectory that found no pending buffer free at its first turn (or, with a K/V strategy, found
``max_streams`` trajectories already holding their segment graphs), or whose group was dropped
meanwhile (a failed groupmate), is not streamed further.

The reward-free terms q_i (KL, entropy) are not split by turn: the ledger runs them in a pass of
their own once the group is known kept, as it does for any pending h_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megathunder.config import RLObjective
from megathunder.objectives.dapo import effective_loss_mask
from megathunder.objectives.importance import tis_weights
from megathunder.streaming.buffers import BufferPool, GradBuffer
from megathunder.streaming.ledger import GradientLedger
from megathunder.streaming.opd_grpo import IntoAccumulator
from megathunder.streaming.opd_turns import SegmentModel, Strategy, TurnStreamer
from megathunder.trajectory import Trajectory


def check_streamable(objective: RLObjective) -> None:
    """Raise unless h_i is a plain sum of per-token log-probability gradients (module docstring)."""
    if objective.tis == "sequence":
        raise ValueError("per-turn score gradients: objective.tis sequence weighs by the whole trajectory")
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
    """The per-turn strategies with turn k's loss L_k = sum_t w_t l_t over its targets."""

    def __init__(self, model: SegmentModel, objective: RLObjective, strategy: Strategy) -> None:
        super().__init__(model, _NoTeacher(), strategy=strategy)
        self.objective = objective
        self.engine_logprobs: torch.Tensor | None = None  # the current turn's, under TIS

    def _turn_loss(self, traj_id: int, all_tokens: torch.Tensor, start: int,
                   logits_for_targets: torch.Tensor) -> torch.Tensor:
        logp = self.model.logprobs(logits_for_targets, all_tokens[start:])
        cfg = self.objective
        mask = torch.ones_like(logp, dtype=torch.bool)
        engine = None if self.engine_logprobs is None else self.engine_logprobs.to(logp)
        weights = tis_weights(logp.detach(), engine, mask, cfg.tis, cfg.tis_cap)
        return (logp if weights is None else logp * weights).sum()


class _IntoPending(IntoAccumulator):
    """Each backward pass moved from the live storage into the current trajectory's pending buffer
    (through the pool: the slots' dtype and placement)."""

    def __init__(self, inner: SegmentModel, live: GradBuffer, pool: BufferPool) -> None:
        super().__init__(inner, live, acc=live)  # acc unused: ``backward`` moves into ``target`` instead
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
    engine: list[torch.Tensor]  # under TIS: the engine logprobs each turn used


class ScoreTurns:
    """Events, on the rank that owns the trajectory: ``on_turn(traj_id, tokens, start, end)`` (turn
    ``tokens[start:end]`` was generated, ``tokens`` the trajectory so far), then ``on_finished(traj)``
    just before ``GradientLedger.on_finished(traj)``."""

    def __init__(self, ledger: GradientLedger, segment_model: SegmentModel, live: GradBuffer,
                 strategy: Strategy = "kv_adjoint", max_streams: int | None = None) -> None:
        check_streamable(ledger.objective)
        self.ledger = ledger
        self.objective = ledger.objective
        self._into = _IntoPending(segment_model, live, ledger.pool)
        self.streamer = _ScoreStreamer(self._into, self.objective, strategy)
        self.max_streams = None if strategy == "recompute" else max_streams  # recompute keeps no state
        self._fed: dict[int, _Fed] = {}
        self._declined: set[int] = set()  # no buffer at the first turn, or its group dropped

    def on_turn(self, traj_id: int, tokens: list[int], start: int, end: int,
                logprobs: list[float] | None = None) -> None:
        """``logprobs``: the engine's, of ``tokens[start:end]`` (needed under ``tis: token``)."""
        if start == end or traj_id in self._declined:
            return
        engine = None
        if self.objective.tis != "none":
            if logprobs is None or len(logprobs) != end - start:
                self._declined.add(traj_id)  # its weights are not known yet: the finish-time path
                if traj_id in self._fed:
                    self._abandon(traj_id)
                    self.ledger.drop_turns(traj_id)
                return
            engine = torch.tensor(logprobs, dtype=torch.float64)  # Python floats: no rounding
        fed = self._fed.get(traj_id)
        if fed is None:
            full = self.max_streams is not None and len(self._fed) >= self.max_streams
            buf = None if full else self.ledger.begin_turns(traj_id)
            if buf is None:
                self._declined.add(traj_id)
                return
            self.streamer.begin_trajectory(traj_id, tokens[:start])
            fed = self._fed[traj_id] = _Fed(end=start, spans=[], engine=[])
        else:
            buf = self.ledger.turn_buffer(traj_id)
            if buf is None:  # its group was dropped: its turns are worth nothing
                self._abandon(traj_id)
                return
            self.streamer.on_tool_output(traj_id, tokens[fed.end : start])  # context only
        self._into.target = buf
        self.streamer.engine_logprobs = engine
        self.streamer.on_turn(traj_id, tokens[start:end])
        fed.end = end
        fed.spans.append((start, end))
        if engine is not None:
            fed.engine.append(engine)

    def on_finished(self, traj: Trajectory) -> None:
        """Finish the trajectory's h_i (kv_adjoint: the reverse sweep), or give its buffer back
        when the turns streamed are not its loss mask."""
        tid = traj.traj_id
        fed = self._fed.get(tid)
        self._declined.discard(tid)
        if fed is None:
            return
        buf = self.ledger.turn_buffer(tid)
        if buf is None or not self._covers(fed, traj):
            self._abandon(tid)
            if buf is not None:
                self.ledger.drop_turns(tid)
            return
        self._into.target = buf
        self.streamer.end_trajectory(tid)
        self.streamer.reset_counts()
        del self._fed[tid]

    def _covers(self, fed: _Fed, traj: Trajectory) -> bool:
        """Are the turns streamed the trajectory's loss terms: its effective loss mask, and under
        TIS its engine logprobs?"""
        if not _spans_are_mask(fed.spans, effective_loss_mask(traj, self.objective.overlong_filter)):
            return False
        if self.objective.tis == "none":
            return True
        if traj.rollout_logprobs is None:
            return False
        return all(torch.equal(e, traj.rollout_logprobs[a - 1 : b - 1].to(e.dtype))  # lossless both ways
                   for e, (a, b) in zip(fed.engine, fed.spans, strict=True))

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
