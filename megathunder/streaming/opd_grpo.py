"""OPD + GRPO: the reverse-KL-to-teacher part streamed per turn, the reward part through the ledger.

The combined batch gradient (one optimizer step per batch, ratio 1 at the evaluation point) is

    grad L = (1/Z) * [ sum_i sum_t c_it grad l_it  +  sum_i -A_i h_i ]
             c_it = beta * m_it * (l_it - l^T_it)          (fixed when turn k of i completes)
             A_i  = the objective's advantage of r_i       (fixed when i's group closes)

with one Z (token_mean: trained tokens of the batch; seq_mean_token_sum: trajectories). The two
sums are independent linear pieces, so each streams on its own schedule: the KL sum per completed
turn (``TurnStreamer``, any strategy), the score sum per trajectory through the ledger's group
slots (``GradientLedger``); at batch close ``grad = P_ledger / Z + KL / Z``.

Both write the backend's live gradient storage (the ledger zeroes it before each of its backward
passes), so the KL part is moved into its own accumulator after every per-turn backward: one
parameter-sized buffer, one add per backward.

Restrictions, checked: loss_agg token_mean or seq_mean_token_sum (the normalisers OPD can stream),
no DAPO dynamic sampling (a dropped group would have to take its KL terms out of the batch), no
KL-to-reference or entropy terms (they would double the per-token regulariser).
"""

from __future__ import annotations

from collections.abc import Sequence

from megathunder.config import LedgerConfig, RLObjective
from megathunder.streaming.buffers import GradBuffer
from megathunder.streaming.ledger import BatchResult, GradientLedger
from megathunder.streaming.opd_turns import SegmentModel, Strategy, Teacher, TurnStreamer
from megathunder.trajectory import Trajectory


class IntoAccumulator:
    """A SegmentModel whose backward passes land in ``acc`` instead of the live storage."""

    def __init__(self, inner: SegmentModel, live: GradBuffer, acc: GradBuffer) -> None:
        self.inner, self.live, self.acc = inner, live, acc
        self.kv_seq_dim = inner.kv_seq_dim

    def forward_segment(self, tokens, past):
        return self.inner.forward_segment(tokens, past)

    def logprobs(self, logits, targets):
        return self.inner.logprobs(logits, targets)

    def log_softmax(self, logits):
        return self.inner.log_softmax(logits)

    def vocab_sum(self, x):
        return self.inner.vocab_sum(x)

    def backward(self, outputs, grads, retain_graph=False):
        self.live.zero_()
        self.inner.backward(outputs, grads, retain_graph)
        self.acc.add_(self.live)

    def divide_grads(self, z):
        raise RuntimeError("OPD + GRPO normalises once, after the ledger's close_batch")


class OPDWithRewards:
    """Events: ``begin_batch(plan)``; per trajectory ``begin_trajectory``, ``on_turn`` /
    ``on_tool_output``, ``end_trajectory(traj)`` (its ``Trajectory``, loss mask = trained tokens);
    ``on_reward`` any time after its end; ``close_batch`` once every group is closed."""

    def __init__(self, backend, segment_model: SegmentModel, teacher: Teacher, objective: RLObjective,
                 ledger_cfg: LedgerConfig | None = None, beta: float = 1.0,
                 strategy: Strategy = "kv_adjoint", max_cached: int | None = None) -> None:
        if objective.loss_agg not in ("token_mean", "seq_mean_token_sum"):
            raise ValueError(f"objective.loss_agg: {objective.loss_agg} cannot be combined with per-turn OPD")
        if objective.dapo_dynamic_sampling or objective.has_reward_free_terms:
            raise ValueError("objective: DAPO dynamic sampling and KL/entropy terms cannot be combined with OPD")
        self.backend = backend
        self.ledger = GradientLedger(backend, objective, ledger_cfg)
        self.kl = backend.zeros()
        self.streamer = TurnStreamer(IntoAccumulator(segment_model, backend.live, self.kl), teacher,
                                     beta=beta, strategy=strategy, aggregation=objective.loss_agg,
                                     max_cached=max_cached)

    def begin_batch(self, groups: Sequence[tuple[int, Sequence[int]]]) -> None:
        self.kl.zero_()
        self.ledger.begin_batch(groups)

    def begin_trajectory(self, traj_id: int, prompt: list[int]) -> None:
        self.streamer.begin_trajectory(traj_id, prompt)

    def on_turn(self, traj_id: int, turn: list[int]) -> None:
        self.streamer.on_turn(traj_id, turn)

    def on_tool_output(self, traj_id: int, tokens: list[int]) -> None:
        self.streamer.on_tool_output(traj_id, tokens)

    def end_trajectory(self, traj: Trajectory) -> None:
        self.streamer.end_trajectory(traj.traj_id)
        self.ledger.on_finished(traj)

    def on_reward(self, traj_id: int, reward: float) -> None:
        self.ledger.on_reward(traj_id, reward)

    def close_batch(self) -> BatchResult:
        result = self.ledger.close_batch()  # live = P / Z
        self.streamer.reset_counts()  # Z is the ledger's (same objective normaliser)
        self.backend.live.add_(self.kl, alpha=1.0 / result.normaliser)
        return result
