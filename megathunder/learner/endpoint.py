"""``LearnerEndpoint``: the calls the controller (global rank 0) makes on every learner rank.

The controller submits ``LearnerEndpoint`` methods to the ``LearnerService``
(``megathunder.learner.service``), which broadcasts each call's name and arguments to the other
ranks and runs it on every rank, in submission order, on the learner's worker thread. Collectives
inside the calls (DP reduce, TP/PP exchange, the weight gather) line up by construction.

One thunder trajectory, from its episode's end to the weight push (GRPO). This is the one copy of
the walk (docs/design.md points here); each numbered line is one hop, file by file, and every
learner call runs on every learner rank, the trajectory's owner doing its backward passes::

     1  rollout/agent_loop.py     AgentLoop._finish: emits RolloutEvent("trajectory_finished"), scores
                                  the episode (the verifier pool), emits ("reward")
     2  trainer/trainer.py        Trainer._on_event: learner.finished(traj), learner.reward(id, r)
     3  learner/client.py         LearnerClient: queued as event calls, a burst sent as one message
     4  learner/service.py        LearnerService: broadcast to every rank, run on the learner thread
     5  learner/endpoint.py       LearnerEndpoint.finished / .reward (below)
     6  learner/batches.py        GRPOBatch.on_finished (DP owner, reference logprobs) / .on_reward
     7  streaming/ledger.py       GradientLedger.on_finished waits for the reward; on_reward runs the
                                  trajectory's backward now (or folds it at its group's close; with
                                  calls queued behind, the work is held and released packed at
                                  LearnerEndpoint.ready_work: GradientLedger.release)
     8  learner/backend.py        MegatronBackend.backward_sum -> ForwardBackward.backward
     9  learner/forward_backward.py   one Megatron schedule call over the micro-batch layouts
                                  (learner/micro_batches.py) -> objectives/loss.py trajectories_loss
    10  trainer/schedules.py      thunder_step: learner.close() -> LearnerEndpoint.close ->
                                  ledger.close_batch(): P / Z into DDP's buffers
    11  trainer/trainer.py        Trainer.finish: learner.step() -> MegatronLearner.step (DP reduce,
                                  optimizer step)
    12  trainer/weight_sync.py    WeightSync.push(version): engine.updating (pause), the workers'
                                  receive_weights beside learner send_weights, resume
    13  learner/push.py           StageSender.send: each PP stage broadcasts its own buckets over
                                  weights/wire.py (FrameWriter) into rollout/engines/worker_extension.py
    14  trainer/probe.py          Probe.start: vLLM's prefill now, the learner's score
                                  (LearnerEndpoint.score) while the next batch generates
    15  trainer/records.py        StepRecords.write once the probe is checked: metrics, journal

OPD, and GRPO with ``ledger.per_turn_scores``, add ``turn`` (a model turn was generated: its
gradient while its tool call runs).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megathunder.learner.batches import Batch, BatchOutcome, new_batch
from megathunder.learner.checkpoint import save_checkpoint
from megathunder.learner.learner import MegatronLearner, StepResult
from megathunder.learner.parallel import from_last_stage
from megathunder.learner.push import StageSender, gather_to_rank0
from megathunder.streaming.opd_turns import CachedTeacher
from megathunder.trajectory import BatchPlan, Trajectory


class LearnerEndpoint:
    """What a learner rank does for the controller; one instance per rank, called in lockstep."""

    WINDOW_CALLS = ("turn", "finished", "reward")
    """The event calls whose backward work may be held for ``ready_work`` (``megathunder.learner.pack_window``)."""
    EVENT_CALLS = ("add_group", *WINDOW_CALLS)
    """The calls the rollout's events make, sent in bursts (``LearnerService.submit_event``)."""

    def __init__(self, learner: MegatronLearner, checkpoint_dir: Path, teacher: CachedTeacher | None = None) -> None:
        self.learner, self.checkpoint_dir, self.teacher = learner, checkpoint_dir, teacher
        self._batch: Batch | None = None
        self.more_queued = False  # set by the service before each call: more calls wait behind it
        self.sender = StageSender(learner.model, learner.model_cfg, learner.pgs, learner.offset)

    # ------------------------------------------------------------------ a batch's events

    def begin(self, plan: BatchPlan, streamed: bool) -> None:
        """A new batch: its groups, and whether its gradient streams (thunder) or comes at close."""
        self._batch = new_batch(self.learner, self.teacher, plan, streamed)

    def add_group(self, group_id: int, traj_ids: list[int]) -> None:
        """One more group joins the open batch (DAPO's refill of a dropped group), before any of its events."""
        self._current().add_group(group_id, traj_ids)

    def turn(self, traj_id: int, tokens: list[int], start: int, end: int, logprobs: list[float] | None = None) -> None:
        """Turn ``tokens[start:end]`` of a trajectory was generated (``logprobs``: the engine's, of
        its tokens); its tool call starts now."""
        self._current().on_turn(traj_id, tokens, start, end, logprobs)

    def finished(self, traj: Trajectory) -> None:
        self._batch_for_event().on_finished(traj)

    def reward(self, traj_id: int, reward: float | None) -> None:
        """``None``: the trajectory failed and its group leaves the batch."""
        self._batch_for_event().on_reward(traj_id, reward)

    def ready_work(self) -> None:
        """The service's hook after a call with nothing queued behind it: the learner is free, so
        it runs everything the calls before held back (``Batch.release_work``)."""
        if self._batch is not None:
            self._batch.release_work()

    def packing(self) -> bool:
        """Would the open batch hold an event's work for ``ready_work`` (thunder with packing on)?"""
        return self._batch is not None and self._batch.holds_work()

    def _batch_for_event(self) -> Batch:
        """The current batch, told to hold its backward work when more calls are queued: a run of
        queued events is bookkept first, and its work goes in packed calls at ``ready_work``."""
        batch = self._current()
        if self.more_queued:
            batch.hold_work()
        return batch

    def close(self) -> BatchOutcome:
        outcome = self._current().close()
        self._batch = None
        return outcome

    def _current(self) -> Batch:
        if self._batch is None:
            raise RuntimeError("learner call outside a batch: begin() first")
        return self._batch

    # ------------------------------------------------------------------ weights and checks

    def step(self) -> StepResult:
        return self.learner.step()

    def join_weight_transfer(self, rendezvous_json: str) -> None:
        """When the engine opens its transfer groups (``WeightSync.connect``: at start-up, and
        after the engine lost a worker): each stage's sender joins its group."""
        self.sender.join(rendezvous_json)

    def send_weights(self) -> dict[str, float]:
        """One push over the transfer groups, each stage sending its own tensors; the push's
        figures (bytes, tensors, changed fraction), summed over the stages."""
        return self.sender.send()

    def gather_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """The rpc fallback: the weights in the inference (HF) layout on global rank 0, None elsewhere."""
        learner = self.learner
        return gather_to_rank0(learner.model, learner.model_cfg, learner.pgs, learner.offset)

    def score(self, tokens: list[int], prompt_len: int, routed_experts: torch.Tensor | None = None,
              temperature: float | None = None) -> torch.Tensor:
        """The learner's logprobs of ``tokens[prompt_len:]`` given what precedes them (every rank),
        at the sampling temperature or ``temperature``; ``routed_experts``: replay the engine's
        routing (``learner.moe.routing_replay``)."""
        mask = torch.zeros(len(tokens) - 1, dtype=torch.bool)
        mask[prompt_len - 1 :] = True
        traj = Trajectory(traj_id=-1, group_id=-1, tokens=torch.tensor(tokens), loss_mask=mask,
                          routed_experts=routed_experts)
        out = self.learner.token_logprobs([traj], temperature=temperature)
        return from_last_stage(self.learner.pgs, None if out is None else out[0][prompt_len - 1 :])

    def checkpoint(self) -> str | None:
        """The learner's state under the run's checkpoints/ (None before its first optimizer step)."""
        path = save_checkpoint(self.learner, self.checkpoint_dir)
        return None if path is None else str(path)

    def export(self, path: str) -> None:
        self.learner.export_hf(path)
