"""Per-turn OPD gradients: each completed agentic turn's gradient while its tool call runs.

A trajectory is [prompt, a_1, o_1, a_2, o_2, ..., a_K] (model turns a_k, tool outputs o_k). Turn
k's loss L_k = sum_{t in a_k} c_t l_t depends on the weights through every earlier token as well
(attention reads the prefix's keys and values), and grad L = sum_k grad L_k exactly, so any way of
computing every grad L_k is exact. Three strategies, all driven by the same events:

``recompute``      at turn k: forward + backward over prefix + turn, loss on turn k's tokens.
                   Stock autograd, no state kept; learner cost grows quadratically with turns.
``kv_adjoint``     at turn k: forward only the new segment (o_{k-1}, a_k) on top of the earlier
                   segments' keys/values taken as *leaves*, and backward L_k: this yields L_k's
                   gradient through this segment's own computations now, plus d L_k / d KV_prefix,
                   which is added to the earlier segments' KV adjoints. At trajectory end one reverse
                   sweep pushes each segment's accumulated KV adjoint back through that segment
                   (last to first), adding the remaining parameter gradients. By linearity of the
                   chain rule, own-loss backward + adjoint backward = the full backward.
``forward_early``  at turn k: forward the new segment with the prefix KV still attached to the
                   graph (no backward); at trajectory end one backward of sum_k L_k.

c_t needs the student's own l_t, which each strategy gets from the forward it runs for the turn.
Gradients accumulate, unnormalised, into the model's gradient storage; ``finish_batch`` divides
by Z once. The first target of a segment is predicted by the previous segment's last position; when
the tool output between two turns is empty that target is trained, and its term reaches back
through the previous segment's graph, which both KV strategies keep until the trajectory ends.

Bounded state. Both K/V strategies keep a trajectory's segment K/V and graphs until it ends, and
``CachedTeacher`` keeps its teacher K/V: memory grows with the trajectories in flight. With
``max_cached`` (``objective.max_cached_trajectories``, per learner rank) at most that many
trajectories hold state at once; one that starts while the limit is reached streams with
``recompute`` and a stateless teacher view (each turn re-scores the prefix) -- the same G_k by a
different exact method, so nothing is dropped and the sum is unchanged. A freed place goes to the
next trajectory that starts.

The streamer is written against two small interfaces, so the same strategies run on the plain
torch decoder (fp64 exactness tests) and on the Megatron learner (``megathunder.learner.segment_model``):
``SegmentModel`` (forward a segment on top of past K/V, token logprobs, backward, divide the
gradient) and ``Teacher`` (per-turn scores; ``CachedTeacher`` keeps each trajectory's teacher K/V
so a turn is scored without re-scoring its prefix).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeGuard, cast

import torch

from megathunder.models.torch_decoder import TorchDecoder
from megathunder.objectives.opd import OPDAggregation, gjsd_terms, opd_coefficients, opd_loss, opd_normaliser

Strategy = Literal["recompute", "kv_adjoint", "forward_early"]
Divergence = Literal["reverse_kl", "gjsd"]
KV = tuple[torch.Tensor, torch.Tensor]
TeacherFn = Callable[[torch.Tensor, int, int], torch.Tensor]
"""teacher(tokens, start, end) -> teacher logprobs of tokens[start:end] given tokens[:start]."""


class SegmentModel(Protocol):
    kv_seq_dim: int  # the sequence dim of the per-layer K/V tensors

    def forward_segment(self, tokens: torch.Tensor, past: Sequence[KV] | None) -> tuple[torch.Tensor, list[KV]]:
        """Logits rows [L, V or V/tp] of ``tokens`` [L] continuing ``past`` (per layer K/V of every
        earlier token), and the segment's own per-layer K/V; differentiable in ``past``."""

    def logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Normalised log-probability rows (this rank's vocabulary slice under TP)."""

    def vocab_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the (whole, possibly sharded) vocabulary dim, differentiable."""

    def backward(self, outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None,
                 retain_graph: bool = False) -> None:
        """Accumulate d(outputs)/d(params) (weighted by ``grads``) into the gradient storage."""

    def divide_grads(self, z: float) -> None: ...


class Teacher(Protocol):
    def score(self, traj_id: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Teacher logprobs of tokens[start:] given tokens[:start] (detached)."""

    def release(self, traj_id: int) -> None: ...


class DistributionTeacher(Teacher, Protocol):
    """A teacher that holds the whole distribution (``CachedTeacher``), as the GJSD needs."""

    def score_log_softmax(self, traj_id: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """The teacher's log-probability rows [n, V(/tp)] predicting tokens[start:]."""


def is_teacher(teacher: TeacherFn | Teacher) -> TypeGuard[Teacher]:
    """A ``Teacher`` object rather than a bare scoring function."""
    return hasattr(teacher, "score")


def gives_distributions(teacher: TeacherFn | Teacher) -> TypeGuard[DistributionTeacher]:
    return hasattr(teacher, "score_log_softmax")


def _logp_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


class TorchSegmentModel:
    """``SegmentModel`` over the plain torch decoder; gradients in the parameters' ``.grad``."""

    kv_seq_dim = 2

    def __init__(self, model: TorchDecoder) -> None:
        self.model = model

    def forward_segment(self, tokens: torch.Tensor, past: Sequence[KV] | None) -> tuple[torch.Tensor, list[KV]]:
        logits, kv = self.model.forward_with_cache(tokens[None], list(past) if past else None)
        return logits[0], kv

    def logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _logp_of(logits, targets)

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits, dim=-1)

    def vocab_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=-1)

    def backward(self, outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None,
                 retain_graph: bool = False) -> None:
        torch.autograd.backward(list(outputs), None if grads is None else list(grads), retain_graph=retain_graph)

    def divide_grads(self, z: float) -> None:
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(z)


class FunctionTeacher:
    """A stateless teacher: every call scores the whole prefix again (tests, references)."""

    def __init__(self, fn: TeacherFn) -> None:
        self.fn = fn

    def score(self, traj_id: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        return self.fn(tokens, start, tokens.numel())

    def release(self, traj_id: int) -> None:
        pass


@dataclass
class _TeacherState:
    num_tokens: int = 0  # tokens forwarded so far
    kv: list[KV] | None = None
    last_logits: torch.Tensor | None = None  # predicts token num_tokens


class CachedTeacher:
    """Forward-only teacher with a K/V cache per trajectory: each call forwards only the tokens
    it has not seen, on top of the cached K/V (the prefix is never re-scored). Student and
    teacher may differ in size; they share the tokenizer (the vocabulary)."""

    def __init__(self, model: SegmentModel) -> None:
        self.model = model
        self._state: dict[int, _TeacherState] = {}
        self.stats = {"forward_tokens": 0}

    @torch.no_grad()
    def score_rows(self, traj_id: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Logit rows predicting tokens[start:], forwarding only the tokens not yet cached."""
        s = self._state.setdefault(traj_id, _TeacherState())
        n, end = s.num_tokens, tokens.numel()
        if not 1 <= start <= end or start < n:
            raise ValueError(f"CachedTeacher: trajectory {traj_id}: scoring from {start} but {n} tokens are cached")
        logits, kv = self.model.forward_segment(tokens[n:end], s.kv)
        self.stats["forward_tokens"] += end - n
        rows = logits[max(start - 1 - n, 0) : end - 1 - n]
        if start == n:  # the first target is predicted by the previous call's last position
            assert s.last_logits is not None  # n >= start >= 1: a previous call forwarded tokens
            rows = torch.cat([s.last_logits[None], rows], dim=0)
        dim = self.model.kv_seq_dim
        s.kv = kv if s.kv is None else [(torch.cat([pk, k], dim), torch.cat([pv, v], dim))
                                        for (pk, pv), (k, v) in zip(s.kv, kv, strict=True)]
        s.num_tokens, s.last_logits = end, logits[-1]
        return rows

    def score(self, traj_id: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        return self.model.logprobs(self.score_rows(traj_id, tokens, start), tokens[start:])

    def score_log_softmax(self, traj_id: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """The teacher's log-probability rows [n, V(/tp)] predicting tokens[start:] (for the GJSD)."""
        return self.model.log_softmax(self.score_rows(traj_id, tokens, start))

    def release(self, traj_id: int) -> None:
        self._state.pop(traj_id, None)

    def uncached(self) -> StatelessTeacher:
        """The same teacher keeping no state: each call forwards the whole prefix."""
        return StatelessTeacher(self)

    @property
    def num_cached(self) -> int:
        return len(self._state)


class StatelessTeacher:
    """A ``CachedTeacher``'s model scoring without a cache (the streamer's view for trajectories
    beyond ``max_cached``): every call forwards tokens[:end] from the start."""

    def __init__(self, cached: CachedTeacher) -> None:
        self.cached = cached

    @torch.no_grad()
    def score_rows(self, traj_id: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        logits, _ = self.cached.model.forward_segment(tokens, None)
        self.cached.stats["forward_tokens"] += tokens.numel()
        return logits[start - 1 : tokens.numel() - 1]

    def score(self, traj_id: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        return self.cached.model.logprobs(self.score_rows(traj_id, tokens, start), tokens[start:])

    def score_log_softmax(self, traj_id: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        return self.cached.model.log_softmax(self.score_rows(traj_id, tokens, start))

    def release(self, traj_id: int) -> None:
        pass


@dataclass
class _Segment:
    kv_out: list[KV]  # attached to this segment's graph
    kv_leaf: list[KV]  # detached copies the next segments read
    last_logits: torch.Tensor  # logits of the segment's last position (predicts the next token)


@dataclass
class _Trajectory:
    tokens: list[int] = field(default_factory=list)  # everything forwarded so far
    pending: list[int] = field(default_factory=list)  # prompt / tool output not yet forwarded
    segments: list[_Segment] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)  # forward_early
    segment_lengths: list[int] = field(default_factory=list)
    num_trained: int = 0
    strategy: Strategy = "kv_adjoint"
    teacher: Teacher | None = None  # the streamer's teacher, or its stateless view
    holds_state: bool = True  # counts against max_cached


class TurnStreamer:
    def __init__(self, model: TorchDecoder | SegmentModel, teacher: TeacherFn | Teacher, beta: float = 1.0,
                 strategy: Strategy = "kv_adjoint", aggregation: OPDAggregation = "token_mean",
                 divergence: Divergence = "reverse_kl", jsd_lam: float = 0.5, max_cached: int | None = None) -> None:
        self.model: SegmentModel = TorchSegmentModel(model) if isinstance(model, torch.nn.Module) else model
        if divergence == "gjsd" and not gives_distributions(teacher):
            raise ValueError("divergence gjsd: the teacher must give whole distributions (CachedTeacher)")
        self.divergence = divergence
        self.jsd_lam = jsd_lam
        # cast: not a Teacher, so a TeacherFn (a TypeGuard narrows only where it holds)
        self.teacher: Teacher = teacher if is_teacher(teacher) else FunctionTeacher(cast(TeacherFn, teacher))
        uncached = getattr(self.teacher, "uncached", None)
        self._stateless_teacher: Teacher = uncached() if uncached is not None else self.teacher
        self.beta = beta
        self.strategy = strategy
        self.aggregation = aggregation
        self.max_cached = max_cached
        self.num_cached = 0  # open trajectories holding state (student K/V and graphs, teacher K/V)
        self._open: dict[int, _Trajectory] = {}
        self._finished_counts: list[int] = []
        self.divergence_sum = 0.0  # sum over trained tokens of the divergence (a metric, detached)
        # Work in token passes (deterministic, unlike time): tokens run forward, and tokens whose
        # activations a backward pass traverses.
        self.stats = {"forward_tokens": 0, "backward_tokens": 0, "backward_calls": 0,
                      "peak_cached": 0, "uncached_trajectories": 0}

    # ------------------------------------------------------------------ events

    def begin_trajectory(self, traj_id: int, prompt: list[int]) -> None:
        if traj_id in self._open:
            raise ValueError(f"trajectory {traj_id} already open")
        if not prompt:
            raise ValueError(f"trajectory {traj_id}: empty prompt")
        holds = self.max_cached is None or self.num_cached < self.max_cached
        t = _Trajectory(pending=list(prompt), strategy=self.strategy if holds else "recompute",
                        teacher=self.teacher if holds else self._stateless_teacher, holds_state=holds)
        if holds:
            self.num_cached += 1
            self.stats["peak_cached"] = max(self.stats["peak_cached"], self.num_cached)
        else:
            self.stats["uncached_trajectories"] += 1
        self._open[traj_id] = t

    def on_tool_output(self, traj_id: int, tokens: list[int]) -> None:
        self._open[traj_id].pending.extend(tokens)

    def on_turn(self, traj_id: int, turn: list[int]) -> None:
        """A model turn finished (its tool call, if any, starts now): compute what it allows."""
        t = self._open[traj_id]
        if not turn:
            return  # nothing trained; its context (pending) waits for the next turn
        segment = t.pending + turn
        start = len(t.tokens) + len(t.pending)  # index of the turn's first token
        t.num_trained += len(turn)
        {"recompute": self._recompute, "kv_adjoint": self._kv_adjoint,
         "forward_early": self._forward_early}[t.strategy](traj_id, t, segment, start, len(turn))
        t.tokens.extend(segment)
        t.pending = []

    def end_trajectory(self, traj_id: int) -> None:
        t = self._open.pop(traj_id)
        if t.strategy == "kv_adjoint":
            for seg in reversed(t.segments):  # the reverse sweep, last segment first
                outs, grads = [], []
                for (k, v), (k_leaf, v_leaf) in zip(seg.kv_out, seg.kv_leaf, strict=True):
                    for out, leaf in ((k, k_leaf), (v, v_leaf)):
                        if leaf.grad is not None:
                            outs.append(out)
                            grads.append(leaf.grad)
                if outs:
                    self.model.backward(outs, grads)
                    self.stats["backward_calls"] += 1
            self.stats["backward_tokens"] += sum(t.segment_lengths[:-1])  # the last has no adjoint
        elif t.strategy == "forward_early" and t.losses:
            self.model.backward([torch.stack(t.losses).sum()], None)
            self.stats["backward_calls"] += 1
            self.stats["backward_tokens"] += sum(t.segment_lengths)
        self.teacher.release(traj_id)
        if t.holds_state:
            self.num_cached -= 1
        self._finished_counts.append(t.num_trained)

    def drop_trajectory(self, traj_id: int) -> None:
        """Forget an open trajectory without its reverse sweep (what its turns added stays where
        it went; the caller discards that)."""
        t = self._open.pop(traj_id, None)
        if t is None:
            return
        self.teacher.release(traj_id)
        if t.holds_state:
            self.num_cached -= 1

    @property
    def finished_counts(self) -> list[int]:
        """Trained-token counts of the trajectories finished since the last ``finish_batch``."""
        return list(self._finished_counts)

    def finish_batch(self, z: float | None = None) -> float:
        """Divide the accumulated gradient by Z once; returns Z. ``z``: the normaliser when this
        streamer holds only part of the batch (data parallel: computed from every rank's counts)."""
        if self._open:
            raise ValueError(f"finish_batch: trajectories {sorted(self._open)} still open")
        if z is None:
            z = opd_normaliser(self._finished_counts, self.aggregation)
        self.model.divide_grads(z)
        self.reset_counts()
        return z

    def reset_counts(self) -> None:
        """Forget the finished trajectories' token counts and divergence (a caller that normalises
        itself)."""
        self._finished_counts = []
        self.divergence_sum = 0.0

    # ------------------------------------------------------------------ strategies

    def _turn_loss(self, traj_id: int, all_tokens: torch.Tensor, start: int,
                   logits_for_targets: torch.Tensor) -> torch.Tensor:
        """sum_t c_t l_t over the turn's targets tokens[start:]; logits_for_targets[i] predicts
        tokens[start + i]."""
        teacher_of = self._open[traj_id].teacher
        scorer = teacher_of if teacher_of is not None else self.teacher
        if self.divergence == "gjsd":  # beta * sum_t JSD_lam(teacher || student) at the turn's positions
            rows_teacher = scorer
            assert gives_distributions(rows_teacher)  # checked in __init__
            student = self.model.log_softmax(logits_for_targets)
            teacher = rows_teacher.score_log_softmax(traj_id, all_tokens, start).to(student)
            divergence = self.model.vocab_sum(gjsd_terms(student, teacher, self.jsd_lam)).sum()
            self.divergence_sum += float(divergence.detach())
            return self.beta * divergence
        targets = all_tokens[start:]
        logp = self.model.logprobs(logits_for_targets, targets)
        teacher = scorer.score(traj_id, all_tokens, start).to(logp)
        mask = torch.ones_like(logp, dtype=torch.bool)
        self.divergence_sum += float((logp.detach() - teacher).sum())  # sampled-token reverse KL
        return opd_loss(logp, opd_coefficients(logp, teacher, mask, self.beta))

    def _recompute(self, traj_id, t: _Trajectory, segment: list[int], start: int, num_turn: int) -> None:
        tokens = torch.tensor(t.tokens + segment)
        logits, _ = self.model.forward_segment(tokens, None)
        self.stats["forward_tokens"] += tokens.numel()
        self.model.backward([self._turn_loss(traj_id, tokens, start, logits[start - 1 : tokens.numel() - 1])], None)
        self.stats["backward_calls"] += 1
        self.stats["backward_tokens"] += tokens.numel()

    def _segment_forward(self, t: _Trajectory, segment: list[int], attach_prefix: bool):
        tokens = torch.tensor(t.tokens + segment)
        seg = tokens[len(t.tokens):]
        past = None
        if t.segments:
            dim = self.model.kv_seq_dim
            source = (lambda s: s.kv_out) if attach_prefix else (lambda s: s.kv_leaf)
            past = [
                (torch.cat([source(s)[i][0] for s in t.segments], dim=dim),
                 torch.cat([source(s)[i][1] for s in t.segments], dim=dim))
                for i in range(len(t.segments[0].kv_out))
            ]
        logits, kv = self.model.forward_segment(seg, past)
        self.stats["forward_tokens"] += seg.numel()
        return tokens, logits, kv

    def _logits_for_turn(self, t: _Trajectory, logits: torch.Tensor, segment_len: int, num_turn: int):
        """Rows predicting the turn's tokens: the previous segment's last row if the turn starts
        the segment (empty tool output), then this segment's rows."""
        first = segment_len - num_turn  # offset of the turn inside the segment
        rows = logits[max(first - 1, 0) : segment_len - 1]
        if first == 0:
            rows = torch.cat([t.segments[-1].last_logits[None], rows], dim=0)
        return rows

    def _kv_adjoint(self, traj_id, t: _Trajectory, segment: list[int], start: int, num_turn: int) -> None:
        tokens, logits, kv = self._segment_forward(t, segment, attach_prefix=False)
        rows = self._logits_for_turn(t, logits, len(segment), num_turn)
        self.model.backward([self._turn_loss(traj_id, tokens, start, rows)], None, retain_graph=True)
        self.stats["backward_calls"] += 1
        self.stats["backward_tokens"] += len(segment)
        t.segment_lengths.append(len(segment))
        leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in kv]
        t.segments.append(_Segment(kv_out=kv, kv_leaf=leaves, last_logits=logits[-1]))

    def _forward_early(self, traj_id, t: _Trajectory, segment: list[int], start: int, num_turn: int) -> None:
        tokens, logits, kv = self._segment_forward(t, segment, attach_prefix=True)
        rows = self._logits_for_turn(t, logits, len(segment), num_turn)
        t.losses.append(self._turn_loss(traj_id, tokens, start, rows))
        t.segment_lengths.append(len(segment))
        t.segments.append(_Segment(kv_out=kv, kv_leaf=kv, last_logits=logits[-1]))


def accumulate_full_trajectory_opd(model: SegmentModel, items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                                   beta: float) -> tuple[list[int], float]:
    """Batch OPD's unnormalised gradient on full trajectories into the model's gradient storage:
    per (tokens [L], trained-target mask [L-1], teacher logprobs [L-1]) one forward, c_t from it,
    one backward. Returns the trained-token counts (for ``opd_normaliser``) and the sum of the
    sampled-token reverse KL l_t - l^T_t over the trained tokens (the metric)."""
    counts, divergence = [], 0.0
    for tokens, mask, teacher_logp in items:
        logits, _ = model.forward_segment(tokens, None)
        logp = model.logprobs(logits[:-1], tokens[1:])
        mask = mask.to(logp.device)
        teacher_logp = teacher_logp.to(logp)
        loss = opd_loss(logp, opd_coefficients(logp, teacher_logp, mask, beta))
        model.backward([loss], None)
        counts.append(int(mask.sum()))
        divergence += float(torch.where(mask, logp.detach() - teacher_logp, 0.0).sum())
    return counts, divergence


def accumulate_full_trajectory_gjsd(model: SegmentModel, items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                                    beta: float, lam: float) -> tuple[list[int], float]:
    """The same for the GJSD: items carry the teacher's log-probability rows [L-1, V(/tp)]."""
    counts, divergence = [], 0.0
    for tokens, mask, teacher_rows in items:
        logits, _ = model.forward_segment(tokens, None)
        student = model.log_softmax(logits[:-1])
        mask = mask.to(student.device)
        per_token = torch.where(mask, model.vocab_sum(gjsd_terms(student, teacher_rows.to(student), lam)), 0.0).sum()
        model.backward([beta * per_token], None)
        counts.append(int(mask.sum()))
        divergence += float(per_token.detach())
    return counts, divergence


def opd_reference_gradient(model: TorchDecoder, trajectories: list[tuple[torch.Tensor, torch.Tensor]],
                           teacher: TeacherFn, beta: float, aggregation: OPDAggregation) -> torch.Tensor:
    """Batch OPD on full trajectories: one forward each, c_t from it, one loss, one backward, /Z.

    ``trajectories``: (tokens [L], trained-target mask [L-1]) pairs. Returns the flat gradient.
    """
    params = list(model.parameters())
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    items = [(tokens, mask, teacher(tokens, 1, tokens.numel())) for tokens, mask in trajectories]
    counts, _ = accumulate_full_trajectory_opd(TorchSegmentModel(model), items, beta)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    for p, g in zip(params, saved, strict=True):
        p.grad = g
    return flat / opd_normaliser(counts, aggregation)
