"""On-policy distillation (``objective.kind: opd``) in the trainer: the batch and its teacher.

``OPDBatch`` has ``BatchGradient``'s events plus ``on_turn``, so every schedule and the replay
drive it unchanged:

    thunder  each ``turn_finished`` event -> ``TurnStreamer.on_turn``: the turn's gradient (through
             its prefix K/V, DESIGN.md section 3) is computed while its tool call runs; the
             trajectory's end closes its K/V adjoints; ``finish_opd_batch`` divides by Z once.
    sync     at batch close, ``opd_batch_gradient``: the teacher scores each whole trajectory, one
             student forward + backward each, one division by Z (the batch reference).

Why the two are equal: the loss is sum_i sum_{t trained} c_it l_it / Z with c_it = beta (l_it -
l^T_it) detached. c_it depends only on the tokens up to t and the current weights -- fixed the
moment turn k containing t is generated, since there is one optimizer step per batch and the
weights do not move before it. So grad L = (1/Z) sum_i sum_k G_ik with G_ik turn k's terms (paths
through the prefix K/V included), a plain sum computed in any order; Z (trained tokens or
trajectories of the whole batch, over every data-parallel rank) is applied once at close. Only
the summation order differs: equal up to float reassociation.

Rewards are not part of the objective (they are still logged: the student's task score), except
under ``objective.kind: opd_grpo`` (``OPDGRPOBatch`` below: the KL term plus the reward term).

Data parallel: a trajectory is owned by the DP rank with the fewest trained tokens when its first
turn arrives (thunder) or when it finishes (sync); every rank sees the same events in the same
order, so ranks agree without talking, and TP peers (same DP rank) stream the same turns.
"""

from __future__ import annotations

from pathlib import Path

from megathunder.config import Config
from megathunder.learner.batches import BatchOutcome, TokenBalancer
from megathunder.trainer.journal import mask_spans
from megathunder.trajectory import Trajectory


class OPDBatch:
    """One batch of OPD on one learner rank; ``streamed`` selects the per-turn (thunder) path."""

    def __init__(self, learner, teacher, plan: list[tuple[int, list[int]]], streamed: bool) -> None:
        self.learner, self.teacher, self.plan, self.streamed = learner, teacher, plan, streamed
        self.balancer = TokenBalancer(learner.groups.dims.dp)
        self.owner: dict[int, int] = {}
        self.fed: dict[int, int] = {}  # streamed: tokens of each own trajectory given to the streamer
        self.mine: list[Trajectory] = []  # sync: this rank's trajectories, in finish order
        self.num_trajectories = 0
        self.streamer = self._new_streamer() if streamed else None
        self._passes_at_last_reward = 0

    def _new_streamer(self):
        return self.learner.turn_streamer(self.teacher)

    def _is_mine(self, traj_id: int, num_tokens: int) -> bool:
        if traj_id not in self.owner:
            self.owner[traj_id] = self.balancer.assign(num_tokens)
        else:
            self.balancer.load[self.owner[traj_id]] += num_tokens
        return self.owner[traj_id] == self.learner.groups.dp_rank

    def on_turn(self, traj_id: int, tokens: list[int], start: int, end: int) -> None:
        """Turn ``tokens[start:end]`` was generated (``tokens``: the trajectory up to its end)."""
        if not self.streamed or start == end or not self._is_mine(traj_id, end - start):
            return
        if traj_id not in self.fed:
            self.streamer.begin_trajectory(traj_id, tokens[:start])
        else:  # tool output and template glue since the last turn: context only
            self.streamer.on_tool_output(traj_id, tokens[self.fed[traj_id] : start])
        self.streamer.on_turn(traj_id, tokens[start:end])
        self.fed[traj_id] = end

    def on_finished(self, traj: Trajectory) -> None:
        self.num_trajectories += 1
        if self.streamed:
            if self.fed.pop(traj.traj_id, None) is not None:
                self.streamer.end_trajectory(traj.traj_id)  # kv_adjoint: its reverse sweep
        elif traj.loss_mask.any() and self._is_mine(traj.traj_id, int(traj.loss_mask.sum())):
            self.mine.append(traj)

    def on_reward(self, traj_id: int, reward: float | None) -> None:
        self._passes_at_last_reward = self._passes()

    def _passes(self) -> int:
        return self.streamer.stats["backward_calls"] if self.streamed else 0

    def close(self) -> BatchOutcome:
        if self.streamed:
            result = self.learner.finish_opd_batch(self.streamer)
            passes = self._passes() - self._passes_at_last_reward
        else:
            result = self.learner.opd_batch_gradient(self.mine, self.teacher)
            passes = len(self.mine)
        return BatchOutcome(num_kept_groups=len(self.plan), num_dropped_groups=0,
                            num_kept_trajectories=self.num_trajectories, peak_buffers=1,
                            backward_after_last_reward=passes, divergence=result.divergence_mean)


class OPDGRPOBatch(OPDBatch):
    """``objective.kind: opd_grpo``: OPD's per-token KL term plus the reward term, one Z
    (``megathunder.streaming.opd_grpo`` derives it: the two sums are independent linear pieces)::

        thunder  turns -> the per-turn streamer as for OPD, each backward moved into its own buffer
                 KL; finish and reward events -> the gradient ledger (group slots); at close
                 grad = P / Z + KL / Z, Z the ledger's (the objective's normaliser, every DP rank)
        sync     at close, ``opd_grpo_batch_gradient``: both parts on whole trajectories, one Z

    A trajectory has one owner DP rank for both parts: OPDBatch's (its first turn under thunder,
    its finish under sync); the ledger of every other rank counts it through ``on_remote_finished``.
    """

    def __init__(self, learner, teacher, plan: list[tuple[int, list[int]]], streamed: bool) -> None:
        self.kl = learner.backend.zeros() if streamed else None
        super().__init__(learner, teacher, plan, streamed)
        self.trajs: dict[int, Trajectory] = {}  # sync: every trajectory (Z counts them all)
        self.rewards: dict[int, float | None] = {}
        learner.backend.num_backward = 0
        if streamed:
            learner.ledger.begin_batch(plan)

    def _new_streamer(self):
        return self.learner.turn_streamer(self.teacher, into=self.kl)

    def on_finished(self, traj: Trajectory) -> None:
        self.num_trajectories += 1
        tid = traj.traj_id
        if tid not in self.owner:  # sync, or no trained token streamed: owned from its finish
            self.owner[tid] = self.balancer.assign(int(traj.loss_mask.sum()))
        mine = self.owner[tid] == self.learner.groups.dp_rank
        if not self.streamed:
            self.trajs[tid] = traj
        elif mine:
            if self.fed.pop(tid, None) is not None:
                self.streamer.end_trajectory(tid)
            self.learner.ledger.on_finished(traj)
        else:
            self.learner.ledger.on_remote_finished(tid, self.learner.num_loss_tokens(traj))

    def on_reward(self, traj_id: int, reward: float | None) -> None:
        self._passes_at_last_reward = self._passes()
        if self.streamed:
            self.learner.ledger.on_reward(traj_id, reward)
        self.rewards[traj_id] = reward

    def _passes(self) -> int:
        return super()._passes() + self.learner.backend.num_backward

    def close(self) -> BatchOutcome:
        if self.streamed:
            closed = self.learner.ledger.close_batch()
            result = self.learner.finish_opd_grpo_batch(self.streamer, self.kl, closed.normaliser)
            passes = self._passes() - self._passes_at_last_reward
            kept, num_kept, peak = closed.num_kept_groups, closed.num_kept_trajectories, closed.peak_buffers + 1
        else:
            order = [tid for _, members in self.plan for tid in members]
            owner = [self.owner[t] for t in order]
            result = self.learner.opd_grpo_batch_gradient([self.trajs[t] for t in order],
                                                          [self.rewards[t] for t in order], owner, self.teacher)
            passes = 2 * owner.count(self.learner.groups.dp_rank)  # a reward and a KL pass each
            kept, num_kept, peak = len(self.plan), len(order), 1
        return BatchOutcome(num_kept_groups=kept, num_dropped_groups=len(self.plan) - kept,
                            num_kept_trajectories=num_kept, peak_buffers=peak,
                            backward_after_last_reward=passes, divergence=result.divergence_mean)


def turn_spans(traj: Trajectory) -> list[tuple[int, int]]:
    """[start, end) token positions of the trajectory's model turns: the runs of its loss mask
    (target t is token t + 1; turns are separated by masked tool output or template glue)."""
    return [(a + 1, b + 1) for a, b in mask_spans(traj.loss_mask)]


def teacher_dir(cfg: Config, run_dir: Path) -> Path:
    """Where the run's OPD teacher is: the configured checkpoint or the one the run built."""
    given = cfg.learner.opd.teacher_hf_checkpoint
    return Path(given) if given is not None else run_dir / "teacher_model"


def build_teacher_model(cfg: Config, run_dir: Path, groups) -> Path:
    """The teacher's HF directory. Unless ``learner.opd.teacher_hf_checkpoint`` is given, the run
    builds one (every rank takes part; done once per run directory): the default tiny model (the
    GRPO quickstart's) SFT-warm-started on the task's reference solutions -- a teacher that
    solves the task, with the student's tokenizer."""
    from megathunder.config.schema import TinyModelConfig
    from megathunder.trainer.run import tiny_model
    from megathunder.trainer.sft import warm_start

    out = teacher_dir(cfg, run_dir)
    if cfg.learner.opd.teacher_hf_checkpoint is not None:
        if not (out / "config.json").is_file():
            raise FileNotFoundError(f"learner.opd.teacher_hf_checkpoint: {out} has no config.json")
        return out
    source = tiny_model(run_dir / "teacher_init", TinyModelConfig(), groups)
    teacher_cfg = cfg.model_copy(update={"sft": cfg.sft.model_copy(
        update={"num_steps": cfg.learner.opd.teacher_sft_num_steps})})
    return warm_start(teacher_cfg, groups, source, out, desc="teacher sft")
