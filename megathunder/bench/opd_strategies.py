"""``megathunder bench opd``: per-turn OPD strategies' cost, for trajectories of 2, 8 and 32 turns.

For each strategy (recompute, kv_adjoint, forward_early), on one trajectory whose turns arrive
one by one (prompt, then turn / tool output alternating), on the small torch decoder or on the
Megatron learner (``--learner megatron``: GPTModel with the past-K/V attention layer spec, one
process, gradients into DDP's buffers):

- learner work in token passes (forward tokens + backward tokens), relative to one full-trajectory
  forward + backward (2 L): deterministic, the figure to choose by;
- the work left after the last turn arrives (the critical path: what delays the step), same unit;
- peak bytes of activations held for backward (saved-tensor hooks), relative to the full pass;
- the same two ratios in measured time (noisy on a shared CPU; small models are dominated by
  per-call overhead, so prefer the token-pass figures there).

The default strategy is chosen from these figures (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import statistics
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from megathunder.config import DecoderConfig
from megathunder.models.torch_decoder import build_torch_decoder
from megathunder.streaming.opd_turns import (
    SegmentModel,
    TeacherFn,
    TorchSegmentModel,
    TurnStreamer,
    accumulate_full_trajectory_opd,
)

Student = tuple[SegmentModel, Callable[[], None], Callable[[], None]]
"""The model under test, how to zero its gradient, and how to close it."""


class _SavedBytes:
    """Bytes of tensors autograd currently holds for backward (live count and peak)."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def __enter__(self) -> _SavedBytes:
        def pack(t):
            n = t.numel() * t.element_size()
            self.live += n
            self.peak = max(self.peak, self.live)
            box = _Box(t, n, self)
            weakref.finalize(box, _release, self, n)
            return box

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


class _Box:
    __slots__ = ("t", "n", "owner", "__weakref__")

    def __init__(self, t, n, owner):
        self.t, self.n, self.owner = t, n, owner


def _release(owner: _SavedBytes, n: int) -> None:
    owner.live -= n


def _torch_student(args: argparse.Namespace, max_len: int) -> Student:
    cfg = DecoderConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
                      num_heads=max(1, args.hidden_size // 64), max_seq_len=max_len)
    student = build_torch_decoder(cfg, seed=0)
    return TorchSegmentModel(student), lambda: student.zero_grad(set_to_none=True), lambda: None


def _megatron_student(args: argparse.Namespace, max_len: int) -> Student:
    """The Megatron learner (one process, past-K/V attention layer spec); gradients in DDP's buffers."""
    from megathunder.config import GRPOObjective, LearnerConfig
    from megathunder.learner.learner import MegatronLearner
    from megathunder.learner.parallel import destroy_distributed, init_distributed
    from megathunder.learner.segment_model import MegatronSegmentModel

    if "MASTER_PORT" not in os.environ:  # one process, no launcher: any free local port
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    heads = max(2, args.hidden_size // 64)
    cfg = LearnerConfig.model_validate({
        "model": {"vocab_size": args.vocab_size, "hidden_size": args.hidden_size,
                  "ffn_hidden_size": 4 * args.hidden_size, "num_layers": args.num_layers,
                  "num_attention_heads": heads, "num_query_groups": heads // 2,
                  "max_position_embeddings": max_len, "tie_word_embeddings": False},
        "precision": {"core_attention": "past_kv"},
        "optimizer": {"name": "sgd", "use_distributed_optimizer": False},
    })
    learner = MegatronLearner.build(cfg, GRPOObjective(), init_distributed(cfg))
    return MegatronSegmentModel(learner.ddp, learner.pgs), learner.ddp.zero_grad_buffer, destroy_distributed


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="megathunder bench opd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--learner", choices=["torch", "megatron"], default="torch",
                   help="the small torch decoder, or the Megatron learner (one process)")
    p.add_argument("--turns", type=int, nargs="+", default=[2, 8, 32])
    p.add_argument("--turn-tokens", type=int, default=32)
    p.add_argument("--tool-tokens", type=int, default=32)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)

    max_len = 16 + max(args.turns) * (args.turn_tokens + args.tool_tokens)
    student, zero_grad, close = (_megatron_student if args.learner == "megatron" else _torch_student)(args, max_len)
    teacher_cfg = DecoderConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
                              num_heads=max(1, args.hidden_size // 64), max_seq_len=max_len)
    teacher = build_torch_decoder(teacher_cfg, seed=1)

    @torch.no_grad()
    def score(tokens, start, end):  # teacher scoring is not learner work: kept outside the timers
        logits = teacher(tokens[None, :end])[0]
        return torch.log_softmax(logits, -1)[start - 1 : end - 1].gather(-1, tokens[start:end, None])[:, 0]

    rows = []
    print(f"learner: {args.learner}")
    print(f"{'turns':>5} {'strategy':<14} {'work/full':>9} {'after last turn':>15} {'activations':>11}"
          f" {'time/full':>9} {'time after last':>15}")
    for num_turns in args.turns:
        rng = random.Random(num_turns)
        tok = lambda n: [rng.randrange(args.vocab_size) for _ in range(n)]  # noqa: E731
        parts = [("prompt", tok(16))]
        for k in range(num_turns):
            parts.append(("turn", tok(args.turn_tokens)))
            if k + 1 < num_turns:
                parts.append(("tool", tok(args.tool_tokens)))
        tokens = torch.tensor([t for _, toks in parts for t in toks])
        mask = torch.tensor([kind == "turn" for kind, toks in parts for _ in toks][1:])
        teacher_logp = score(tokens, 1, tokens.numel())

        def full_pass(measure_memory: bool):
            zero_grad()
            with _SavedBytes() if measure_memory else contextlib.nullcontext() as saved:
                t0 = time.perf_counter()
                accumulate_full_trajectory_opd(student, [(tokens, mask, teacher_logp)], 1.0)
                elapsed = time.perf_counter() - t0
            return elapsed, saved.peak if saved is not None else 0

        full_bytes = full_pass(True)[1]
        full_s = statistics.median(full_pass(False)[0] for _ in range(args.repeats + 1))
        for strategy in ("recompute", "kv_adjoint", "forward_early"):
            totals, tails, peaks, work, work_tail = [], [], [], [], []
            for rep in range(args.repeats + 2):  # run 0 measures memory (hooks distort time)
                zero_grad()
                timed = _Timed(score)
                streamer = TurnStreamer(student, timed, strategy=strategy)
                with _SavedBytes() if rep == 0 else contextlib.nullcontext() as saved:
                    t0 = time.perf_counter()
                    streamer.begin_trajectory(0, parts[0][1])
                    for kind, toks in parts[1:]:
                        if kind == "turn":
                            t_last = time.perf_counter()
                            tool_before = timed.seconds
                            passes_before = streamer.stats["forward_tokens"] + streamer.stats["backward_tokens"]
                            streamer.on_turn(0, toks)
                        else:
                            streamer.on_tool_output(0, toks)
                    streamer.end_trajectory(0)
                    end = time.perf_counter()
                totals.append(end - t0 - timed.seconds)
                tails.append(end - t_last - (timed.seconds - tool_before))
                if rep == 0:
                    assert saved is not None  # run 0 measures memory
                    peaks.append(saved.peak)
                    continue
                passes = streamer.stats["forward_tokens"] + streamer.stats["backward_tokens"]
                work.append(passes / (2 * len(tokens)))
                work_tail.append((passes - passes_before) / (2 * len(tokens)))
            row = {"learner": args.learner, "turns": num_turns, "strategy": strategy,
                   "work_vs_full": round(work[-1], 3),
                   "work_after_last_turn_vs_full": round(work_tail[-1], 3),
                   "activations_vs_full": round(peaks[0] / full_bytes, 3),
                   "time_vs_full": round(statistics.median(totals[1:]) / full_s, 3),
                   "time_after_last_turn_vs_full": round(statistics.median(tails[1:]) / full_s, 3),
                   "full_pass_s": round(full_s, 4)}
            rows.append(row)
            print(f"{num_turns:>5} {strategy:<14} {row['work_vs_full']:>9.2f} "
                  f"{row['work_after_last_turn_vs_full']:>15.2f} {row['activations_vs_full']:>11.2f}"
                  f" {row['time_vs_full']:>9.2f} {row['time_after_last_turn_vs_full']:>15.2f}")
    print(json.dumps({"bench": "opd", "rows": rows}))
    close()
    return 0


class _Timed:
    """A stateless teacher whose time is taken out of the learner's."""

    def __init__(self, fn: TeacherFn) -> None:
        self.fn, self.seconds = fn, 0.0

    def score(self, traj_id: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.fn(tokens, start, tokens.numel())
        self.seconds += time.perf_counter() - t0
        return out

    def release(self, traj_id: int) -> None:
        pass
