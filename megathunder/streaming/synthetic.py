"""Synthetic batches and event orders, for exactness checks, the demo and benchmarks.

A batch here has everything a real one has: prompts, model turns interleaved with masked
tool-output segments, empty completions, truncated (overlong) trajectories, rollout-engine
logprobs that differ slightly from the learner's, and reference-model logprobs. Events arrive in a
random order that respects causality (a trajectory's reward comes after it finishes).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from megathunder.streaming.ledger import GradientLedger
from megathunder.trajectory import Trajectory


@dataclass(frozen=True)
class Event:
    kind: Literal["finished", "reward"]
    traj_id: int


def random_trajectory(
    rng: random.Random,
    traj_id: int,
    group_id: int,
    vocab_size: int,
    max_len: int,
    dtype: torch.dtype,
    empty_completion: bool = False,
) -> Trajectory:
    prompt_len = rng.randint(1, max(1, max_len // 4))
    completion_len = 0 if empty_completion else rng.randint(1, max_len - prompt_len)
    length = prompt_len + completion_len
    if length < 2:  # a target needs two tokens; an empty completion on a 1-token prompt
        prompt_len, length = 2, 2
    gen = torch.Generator().manual_seed(rng.getrandbits(31))
    tokens = torch.randint(0, vocab_size, (length,), generator=gen)
    mask = torch.zeros(length - 1, dtype=torch.bool)
    mask[prompt_len - 1 :] = True
    # Tool-output segments inside the completion are not trained on.
    for _ in range(rng.randint(0, 2)):
        if completion_len > 4:
            start = prompt_len - 1 + rng.randint(1, completion_len - 2)
            mask[start : start + rng.randint(1, 3)] = False
    rollout = -torch.rand(length - 1, generator=gen, dtype=dtype) * 4.0
    ref = rollout + 0.3 * torch.randn(length - 1, generator=gen, dtype=dtype)
    return Trajectory(
        traj_id=traj_id,
        group_id=group_id,
        tokens=tokens,
        loss_mask=mask,
        rollout_logprobs=rollout,
        ref_logprobs=ref,
        truncated=rng.random() < 0.15,
    )


def random_batch(
    rng: random.Random,
    group_sizes: Sequence[int],
    vocab_size: int,
    max_len: int,
    dtype: torch.dtype = torch.float32,
    empty_prob: float = 0.1,
) -> list[Trajectory]:
    batch: list[Trajectory] = []
    for gid, size in enumerate(group_sizes):
        for _ in range(size):
            batch.append(
                random_trajectory(
                    rng, len(batch), gid, vocab_size, max_len, dtype,
                    empty_completion=rng.random() < empty_prob,
                )
            )
    return batch


def random_rewards(rng: random.Random, batch: Sequence[Trajectory], kind: str) -> list[float]:
    """binary (0/1), continuous (N(0,1)), large_offset (1e4 + small noise), or equal (all 1.0)."""
    if kind == "binary":
        return [float(rng.random() < 0.5) for _ in batch]
    if kind == "continuous":
        return [rng.gauss(0.0, 1.0) for _ in batch]
    if kind == "large_offset":
        return [1e4 + rng.gauss(0.0, 1.0) * 1e-2 for _ in batch]
    if kind == "equal":
        return [1.0 for _ in batch]
    raise ValueError(f"unknown reward kind {kind!r}")


def random_event_order(rng: random.Random, num_trajs: int) -> list[Event]:
    """A random interleaving of finish and reward events with each reward after its finish."""
    pending_finish = list(range(num_trajs))
    rng.shuffle(pending_finish)
    finished: list[int] = []
    order: list[Event] = []
    while pending_finish or finished:
        if pending_finish and (not finished or rng.random() < 0.5):
            tid = pending_finish.pop()
            order.append(Event("finished", tid))
            finished.append(tid)
        else:
            tid = finished.pop(rng.randrange(len(finished)))
            order.append(Event("reward", tid))
    return order


def sample_order_events(num_trajs: int) -> list[Event]:
    """finish(0), reward(0), finish(1), reward(1), ...: the oracle order."""
    return [Event(kind, i) for i in range(num_trajs) for kind in ("finished", "reward")]


def feed_events(
    ledger: GradientLedger,
    batch: Sequence[Trajectory],
    rewards: Sequence[float],
    events: Sequence[Event],
    owner: Callable[[Trajectory], bool] | None = None,
    num_loss_tokens: Callable[[Trajectory], int] | None = None,
    queued: Sequence[bool] | None = None,
) -> None:
    """Deliver ``events`` to a gradient ledger. With ``owner``, trajectories it rejects finish as
    another data-parallel rank's (their loss-token count from ``num_loss_tokens``). ``queued[k]``:
    more events were queued behind event k, as the learner service reports it -- the ledger holds
    its work before the event and releases it after one with nothing queued (``LearnerEndpoint``)."""
    by_id = {t.traj_id: t for t in batch}
    reward_of = {t.traj_id: r for t, r in zip(batch, rewards, strict=True)}
    for k, ev in enumerate(events):
        more = queued is not None and queued[k]
        if more:
            ledger.hold()
        _deliver(ledger, by_id, reward_of, ev, owner, num_loss_tokens)
        if not more:
            ledger.release()


def _deliver(ledger: GradientLedger, by_id: dict[int, Trajectory], reward_of: dict[int, float], ev: Event,
             owner: Callable[[Trajectory], bool] | None, num_loss_tokens: Callable[[Trajectory], int] | None) -> None:
    traj = by_id[ev.traj_id]
    if ev.kind == "reward":
        ledger.on_reward(ev.traj_id, reward_of[ev.traj_id])
    elif owner is None or owner(traj):
        ledger.on_finished(traj)
    else:
        assert num_loss_tokens is not None, "feed_events: owner needs num_loss_tokens"
        ledger.on_remote_finished(ev.traj_id, num_loss_tokens(traj))
