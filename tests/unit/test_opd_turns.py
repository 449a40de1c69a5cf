"""Per-turn OPD streaming equals full-trajectory OPD (fp64, small torch decoder)."""

from __future__ import annotations

import random

import pytest
import torch

from megathunder.streaming.opd_turns import TurnStreamer, opd_reference_gradient
from tests import opd_helpers
from tests.helpers import VOCAB, rel_err, small_model
from tests.opd_helpers import flatten, stream



def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient (zeros where none), flattened in parameter order."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])

def _teacher_fn(teacher):
    @torch.no_grad()
    def score(tokens: torch.Tensor, start: int, end: int) -> torch.Tensor:
        logits = teacher(tokens[None, :end])[0]
        return torch.log_softmax(logits, -1)[start - 1 : end - 1].gather(-1, tokens[start:end, None])[:, 0]
    return score


def random_episode(rng: random.Random):
    return opd_helpers.random_episode(rng, VOCAB)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("strategy", ["recompute", "kv_adjoint", "forward_early"])
def test_per_turn_streaming_equals_full_trajectory_opd(strategy, aggregation):
    student, teacher = small_model("float64", seed=0), small_model("float64", seed=7)
    score = _teacher_fn(teacher)
    for seed in range(6):
        rng = random.Random(seed)
        episodes = [random_episode(rng) for _ in range(4)]
        full = [flatten(e) for e in episodes]
        if sum(int(m.sum()) for _, m in full) == 0:
            continue
        reference = opd_reference_gradient(student, full, score, beta=0.7, aggregation=aggregation)
        with torch.no_grad():  # sum over trained tokens of l - l^T: the trainer's opd/reverse_kl * count
            student_score = _teacher_fn(student)  # the student's own logprobs, scored the same way
            divergence = sum(float((student_score(t, 1, t.numel()) - score(t, 1, t.numel()))[m].sum()) for t, m in full)
        for p in student.parameters():
            p.grad = None
        streamer = TurnStreamer(student, score, beta=0.7, strategy=strategy, aggregation=aggregation)
        check_streamed(streamer, episodes, student, reference, divergence, (strategy, seed))


def check_streamed(streamer, episodes, student, reference, divergence: float, case) -> None:
    """Stream the episodes; the logged divergence and the gradient equal the full-trajectory ones."""
    stream(streamer, episodes)
    assert streamer.divergence_sum == pytest.approx(divergence, rel=1e-10)  # the logged metric
    streamer.finish_batch()
    assert reference.norm() > 0
    assert rel_err(flat_grad(student), reference) <= 1e-10, case


def test_kv_adjoint_leaves_little_work_after_the_last_turn():
    """What the strategies leave for after the last turn, in forwarded tokens: recompute re-runs
    the whole trajectory at its last turn; the KV strategies forward only the last segment."""
    student, teacher = small_model("float64"), small_model("float64", seed=7)
    score = _teacher_fn(teacher)
    rng = random.Random(3)
    parts = [("prompt", [1, 2, 3])]
    for _ in range(6):
        parts += [("turn", [rng.randrange(VOCAB) for _ in range(3)]), ("tool", [4, 5])]
    parts = parts[:-1]
    forwarded = {}
    for strategy in ("recompute", "kv_adjoint", "forward_early"):
        streamer = TurnStreamer(student, score, strategy=strategy)
        stream(streamer, [parts])
        forwarded[strategy] = streamer.stats["forward_tokens"]
    total = len(flatten(parts)[0])
    assert forwarded["kv_adjoint"] == forwarded["forward_early"] == total
    assert forwarded["recompute"] > 3 * total


def _bigger_teacher():
    from megathunder.config import DecoderConfig
    from megathunder.models.torch_decoder import build_torch_decoder
    from tests.helpers import MAX_LEN

    cfg = DecoderConfig(vocab_size=VOCAB, hidden_size=24, num_layers=3, num_heads=3, max_seq_len=MAX_LEN,
                      dtype="float64")
    return build_torch_decoder(cfg, seed=11)


@pytest.mark.parametrize("strategy", ["recompute", "kv_adjoint"])
def test_cached_teacher_scores_turns_without_rescoring_the_prefix(strategy):
    """A teacher of another size with a per-trajectory K/V cache: the streamed gradient equals the
    reference that scores whole trajectories, and the teacher forwards each token exactly once."""
    from megathunder.streaming.opd_turns import CachedTeacher, TorchSegmentModel

    student, teacher = small_model("float64", seed=0), _bigger_teacher()
    score = _teacher_fn(teacher)
    rng = random.Random(2)
    episodes = [random_episode(rng) for _ in range(5)]
    full = [flatten(e) for e in episodes]
    reference = opd_reference_gradient(student, full, score, beta=1.0, aggregation="token_mean")
    for p in student.parameters():
        p.grad = None
    cached = CachedTeacher(TorchSegmentModel(teacher))
    streamer = TurnStreamer(student, cached, strategy=strategy)
    stream(streamer, episodes)
    streamer.finish_batch()
    streamed = torch.cat([p.grad.reshape(-1) for p in student.parameters()])
    assert rel_err(streamed, reference) <= 1e-10
    # Every token up to each trajectory's last trained token, forwarded once.
    last_trained = [max((i for i in range(len(m)) if m[i]), default=-1) + 2 for _, m in full]
    assert cached.stats["forward_tokens"] == sum(n for n in last_trained if n > 1)
    assert not cached._state  # released at trajectory end


@pytest.mark.parametrize("strategy", ["recompute", "kv_adjoint", "forward_early"])
def test_gjsd_per_turn_equals_full_trajectory(strategy):
    """The GKD-style generalized JSD (teacher's whole distribution from its K/V cache) streams per
    turn as exactly as the reverse KL."""
    from megathunder.objectives.opd import opd_normaliser
    from megathunder.streaming.opd_turns import (
        CachedTeacher,
        TorchSegmentModel,
        accumulate_full_trajectory_gjsd,
    )

    student, teacher = small_model("float64", seed=0), _bigger_teacher()
    for seed in range(3):
        rng = random.Random(seed)
        episodes = [random_episode(rng) for _ in range(4)]
        full = [flatten(e) for e in episodes]
        student.zero_grad(set_to_none=True)
        with torch.no_grad():
            items = [(t, m, torch.log_softmax(teacher(t[None])[0, :-1], -1)) for t, m in full]
        counts, divergence = accumulate_full_trajectory_gjsd(TorchSegmentModel(student), items, beta=0.8, lam=0.3)
        reference = flat_grad(student) / opd_normaliser(counts, "token_mean")
        student.zero_grad(set_to_none=True)
        streamer = TurnStreamer(student, CachedTeacher(TorchSegmentModel(teacher)), beta=0.8, strategy=strategy,
                                divergence="gjsd", jsd_lam=0.3)
        check_streamed(streamer, episodes, student, reference, divergence, (strategy, seed))


def test_gjsd_is_the_jensen_shannon_divergence():
    from megathunder.objectives.opd import gjsd_terms

    g = torch.Generator().manual_seed(0)
    s = torch.log_softmax(torch.randn(5, 11, generator=g, dtype=torch.float64), -1)
    t = torch.log_softmax(torch.randn(5, 11, generator=g, dtype=torch.float64), -1)
    lam = 0.3
    m = lam * t.exp() + (1 - lam) * s.exp()
    expected = lam * (t.exp() * (t - m.log())).sum(-1) + (1 - lam) * (s.exp() * (s - m.log())).sum(-1)
    torch.testing.assert_close(gjsd_terms(s, t, lam).sum(-1), expected)
    assert torch.all(gjsd_terms(s, s, lam).sum(-1).abs() < 1e-12)


@pytest.mark.parametrize("divergence", ["reverse_kl", "gjsd"])
@pytest.mark.parametrize("limit", [0, 1, 2])
@pytest.mark.parametrize("strategy", ["kv_adjoint", "forward_early"])
def test_bounded_state_falls_back_to_recompute_and_stays_exact(strategy, limit, divergence):
    """``max_cached``: at most ``limit`` trajectories hold student and teacher state at any event;
    the others recompute with a stateless teacher, and the gradient is still the full-trajectory
    one. Trajectories start at their first turn (as on the learner), so freed places are reused."""
    from megathunder.objectives.opd import opd_normaliser
    from megathunder.streaming.opd_turns import CachedTeacher, TorchSegmentModel, accumulate_full_trajectory_gjsd

    student, teacher = small_model("float64", seed=0), _bigger_teacher()
    rng = random.Random(11)
    episodes = [random_episode(rng) for _ in range(6)]
    full = [flatten(e) for e in episodes]
    if divergence == "gjsd":
        with torch.no_grad():
            items = [(t, m, torch.log_softmax(teacher(t[None])[0, :-1], -1)) for t, m in full]
        student.zero_grad(set_to_none=True)
        counts, _ = accumulate_full_trajectory_gjsd(TorchSegmentModel(student), items, beta=1.0, lam=0.5)
        reference = flat_grad(student) / opd_normaliser(counts, "token_mean")
    else:
        reference = opd_reference_gradient(student, full, _teacher_fn(teacher), beta=1.0, aggregation="token_mean")
    student.zero_grad(set_to_none=True)
    cached = CachedTeacher(TorchSegmentModel(teacher))
    streamer = TurnStreamer(student, cached, strategy=strategy, divergence=divergence, max_cached=limit)
    started = set()
    for kind, tid, k in opd_helpers.interleaved({tid: len(p) - 1 for tid, p in enumerate(episodes)}, random.Random(3)):
        if tid not in started:
            streamer.begin_trajectory(tid, episodes[tid][0][1])
            started.add(tid)
        if kind == "part":
            opd_helpers.feed_parts(streamer, tid, episodes[tid][1 + k])
        else:
            streamer.end_trajectory(tid)
        assert streamer.num_cached <= limit and cached.num_cached <= limit
        assert sum(len(t.segments) > 0 for t in streamer._open.values()) <= limit  # student K/V + graphs
    streamer.finish_batch()
    assert rel_err(flat_grad(student), reference) <= 1e-10
    assert streamer.stats["peak_cached"] <= limit
    assert streamer.stats["uncached_trajectories"] > 0  # the bound was hit (a fixed interleaving)
    if limit == 0:
        assert streamer.stats["uncached_trajectories"] == len(episodes)
