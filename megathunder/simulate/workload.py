"""Sampling one GRPO batch of agent trajectories from a profile's distributions.

A trajectory is [prompt, a_1, o_1, a_2, ..., a_n]: n model turns a_k (decoded by a rollout
engine), n - 1 tool calls (sandbox latency, then their outputs o_k are prefilled), and a verifier
run whose end is the reward. Per-turn quantities are stored flat (CSR: ``turn_start[i]`` is
trajectory i's first turn), so thousands of trajectories cost a few numpy calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from megathunder.simulate.profile import WorkloadSpec


@dataclass(frozen=True)
class Batch:
    group: np.ndarray  # [B] group index of each trajectory
    prompt_tokens: np.ndarray  # [B]
    turn_start: np.ndarray  # [B + 1] offsets into the per-turn arrays
    decode_tokens: np.ndarray  # [num_turns] tokens generated in each turn
    observation_tokens: np.ndarray  # [num_turns] tool output after the turn (0 after the last)
    tool_latency_s: np.ndarray  # [num_turns] tool call after the turn (0 after the last)
    verifier_latency_s: np.ndarray  # [B]
    decode_s: np.ndarray | None = None  # [num_turns] measured seconds each turn generated: replayed
    work_s: np.ndarray | None = None  # [B] measured learner seconds of each trajectory: replayed
    setup_s: np.ndarray | None = None  # [B] seconds before its first turn (sandbox and task set-up): replayed
    reward_value: np.ndarray | None = None  # [B] 0 / 1 (``solve_rate``); None: all distinct in a group

    @property
    def size(self) -> int:
        return len(self.group)

    @property
    def num_turns(self) -> np.ndarray:
        return np.diff(self.turn_start)

    @property
    def total_tokens(self) -> np.ndarray:
        """[B] tokens the learner runs forward and backward over (the whole context)."""
        per_turn = self.decode_tokens + self.observation_tokens
        return self.prompt_tokens + np.add.reduceat(per_turn, self.turn_start[:-1])

    @property
    def num_loss_tokens(self) -> np.ndarray:
        return np.add.reduceat(self.decode_tokens, self.turn_start[:-1])


def sample_batch(spec: WorkloadSpec, rng: np.random.Generator) -> Batch:
    G, S = spec.num_prompts_per_batch, spec.samples_per_prompt
    B = G * S
    group = np.repeat(np.arange(G), S)
    rho = spec.prompt_difficulty_share
    z = np.sqrt(rho) * rng.standard_normal(G)[group] + np.sqrt(1 - rho) * rng.standard_normal(B)
    turns = np.maximum(1, np.rint(spec.turns.sample(rng, B, z))).astype(np.int64)
    prompt = np.rint(spec.prompt_tokens.sample(rng, B)).astype(np.int64)
    n = int(turns.sum())
    dec = np.maximum(1, np.rint(spec.tokens_per_turn.sample(rng, n))).astype(np.int64)
    obs = np.rint(spec.observation_tokens_per_turn.sample(rng, n)).astype(np.int64)
    tool = spec.tool_latency_s.sample(rng, n)
    start = np.concatenate([[0], np.cumsum(turns)])
    last = start[1:] - 1
    obs[last] = 0
    tool[last] = 0.0

    # Context limit: a trajectory ends with the last turn that fits (at least one turn).
    ctx = np.cumsum(dec + obs)
    ctx -= np.repeat(np.concatenate([[0], ctx[last[:-1]]]), turns)  # per-trajectory cumsum
    ctx += np.repeat(prompt, turns)
    fits = ctx <= spec.max_context_tokens
    fits[start[:-1]] = True
    keep_turns = np.add.reduceat(fits.astype(np.int64), start[:-1])
    if (keep_turns < turns).any():
        # Turns that fit form a prefix of each trajectory (ctx increases); keep those.
        idx = np.arange(n) - np.repeat(start[:-1], turns)
        keep = idx < np.repeat(keep_turns, turns)
        dec, obs, tool = dec[keep], obs[keep], tool[keep]
        turns = keep_turns
        start = np.concatenate([[0], np.cumsum(turns)])
        last = start[1:] - 1
        obs[last] = 0
        tool[last] = 0.0
    return Batch(group=group, prompt_tokens=prompt, turn_start=start, decode_tokens=dec,
                 observation_tokens=obs, tool_latency_s=tool,
                 verifier_latency_s=spec.verifier_latency_s.sample(rng, B),
                 reward_value=_rewards(spec, group, rng))


def _rewards(spec: WorkloadSpec, group: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
    """Binary rewards, 1 where a latent (its group's share ``solve_prompt_share``) falls below the
    ``solve_rate`` quantile. Drawn after everything else, so a profile without them samples the
    same batches."""
    p = spec.solve_rate
    if p is None:
        return None
    rho = spec.solve_prompt_share
    task = rng.standard_normal(int(group.max()) + 1)[group]
    x = np.sqrt(rho) * task + np.sqrt(1 - rho) * rng.standard_normal(len(group))
    threshold = NormalDist().inv_cdf(p) if 0 < p < 1 else (np.inf if p == 1 else -np.inf)
    return (x < threshold).astype(float)
