"""``MegatronLearner``: the policy, its optimizer, the gradient ledger and the reference model.

    learner = MegatronLearner.build(cfg, objective, groups)
    learner.ledger.begin_batch(plan)              # thunder: events in any order ...
    learner.ledger.on_finished(traj); learner.ledger.on_reward(tid, r) ...
    learner.ledger.close_batch(); learner.step()  # ... one DP reduce + optimizer step per batch
    learner.sync_step_gradient(batch, rewards, owner); learner.step()   # batch-synchronous path
    streamer = learner.turn_streamer(teacher)     # per-turn OPD (learner.opd): turn events ...
    learner.finish_opd_batch(streamer); learner.step()
    learner.opd_batch_gradient(batch, teacher); learner.step()   # OPD's batch reference
    streamer = learner.turn_streamer(teacher, into=kl)   # opd_grpo: KL per turn + the ledger ...
    learner.ledger.close_batch(); learner.finish_opd_grpo_batch(streamer, kl, z); learner.step()
    learner.opd_grpo_batch_gradient(batch, rewards, owner, teacher); learner.step()   # its reference

Both paths leave the final gradient in DDP's buffers before ``step`` reduces it across
data-parallel ranks (a sum: each rank holds its trajectories' share of (1/Z) sum_i grad loss_i).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megathunder.config import LearnerConfig, ObjectiveConfig, PolicyModelConfig
from megathunder.learner import hf
from megathunder.learner.backend import MegatronBackend, run_schedule
from megathunder.learner.model import build_gpt_model, layer_offset, resolve_model_config
from megathunder.learner.parallel import ProcessGroups
from megathunder.objectives import LossSpec, num_loss_tokens, trajectory_loss
from megathunder.streaming.reference import batch_advantages
from megathunder.streaming import GradientLedger
from megathunder.trajectory import Trajectory


@dataclass(frozen=True)
class StepResult:
    ok: bool
    grad_norm: float
    lr: float


@dataclass(frozen=True)
class OPDBatchResult:
    normaliser: float  # Z of the whole batch (every data-parallel rank's trajectories)
    divergence_mean: float  # per trained token over the batch: the sampled-token reverse KL (or GJSD)


class MegatronLearner:
    def __init__(self, cfg: LearnerConfig, model_cfg: PolicyModelConfig, objective: ObjectiveConfig,
                 groups: ProcessGroups, model, ddp, optimizer, scheduler, ledger_cfg=None,
                 reference: torch.nn.Module | None = None) -> None:
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.objective = objective
        self.groups = groups
        self.model = model
        self.ddp = ddp
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.offset = layer_offset(model_cfg, groups)
        self.backend = MegatronBackend(ddp, groups, objective)
        self.ledger = GradientLedger(self.backend, objective, ledger_cfg)
        self.reference = reference
        self.num_steps = 0

    @classmethod
    def build(cls, cfg: LearnerConfig, objective: ObjectiveConfig, groups: ProcessGroups, ledger_cfg=None):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        model_cfg = resolve_model_config(cfg)
        model = build_gpt_model(model_cfg, cfg.precision, groups)
        offset = layer_offset(model_cfg, groups)
        if cfg.model.hf_checkpoint is not None:
            hf.import_hf(model, cfg.model.hf_checkpoint, model_cfg, groups, offset)
        opt = cfg.optimizer
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=opt.use_distributed_optimizer,
            average_in_collective=False,
        )
        ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model,
                                      pg_collection=groups.collection)
        bf16 = cfg.precision.params_dtype == "bfloat16"
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer=opt.name, lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
                adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
                clip_grad=opt.clip_grad, use_distributed_optimizer=opt.use_distributed_optimizer,
                bf16=bf16, params_dtype=model.config.params_dtype,
            ),
            [ddp],
            use_gloo_process_groups=False,
            pg_collection=groups.collection,
        )
        decay_steps = opt.lr_decay_steps or max(opt.lr_warmup_steps + 1, 1)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if opt.lr_warmup_steps else opt.lr, max_lr=opt.lr, min_lr=opt.min_lr,
            lr_warmup_steps=opt.lr_warmup_steps, lr_decay_steps=max(decay_steps, opt.lr_warmup_steps + 1),
            lr_decay_style=opt.lr_decay_style, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
            wd_incr_steps=1, wd_incr_style="constant",
        )
        reference = None
        if objective.kl_coef > 0:  # a frozen copy of the initial policy
            reference = build_gpt_model(model_cfg, cfg.precision, groups)
            reference.load_state_dict(model.state_dict(), strict=False)
            reference.requires_grad_(False).eval()
            if cfg.reference.offload_to_cpu and groups.device.type == "cuda":
                reference.to("cpu")
        return cls(cfg, model_cfg, objective, groups, model, ddp, optimizer, scheduler, ledger_cfg, reference)

    # ------------------------------------------------------------------ gradients

    def sync_step_gradient(self, batch: Sequence[Trajectory], rewards: Sequence[float],
                           owner: Sequence[int] | None = None) -> None:
        """Batch-synchronous: every reward known; this rank's kept trajectories as the micro-batches
        of one schedule call; unnormalised sum, then one division by Z (same functions as the
        ledger and the plain reference)."""
        advantages, z = batch_advantages(batch, rewards, self.objective)
        self.ddp.zero_grad_buffer()
        self._reward_terms(batch, advantages, owner)
        self.backend.live.div_(z)

    def _reward_terms(self, batch, advantages, owner) -> list[int]:
        """This rank's kept trajectories' unnormalised loss gradients, added to DDP's buffers as
        the micro-batches of one schedule call; returns their indices."""
        mine = [i for i, a in enumerate(advantages)
                if a is not None and (owner is None or owner[i] == self.groups.dp_rank)]
        if mine:
            items = [batch[i] for i in mine]
            specs = [LossSpec(advantage=advantages[i], reward_free=self.objective.has_reward_free_terms) for i in mine]
            with self.ddp.no_sync():
                run_schedule(
                    self.ddp, self.groups, items,
                    lambda k, logp, ent: trajectory_loss(logp, ent, items[k], specs[k], self.objective),
                    need_entropy=self.objective.entropy_coef > 0,
                )
        return mine

    def step(self) -> StepResult:
        """Reduce the gradient in DDP's buffers across data-parallel ranks once, then step."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp], None, pg_collection=self.groups.collection)
        ok, grad_norm, _ = self.optimizer.step()
        # The optimizer aliased param.grad to main_grad; a later backward would then add each
        # gradient twice (autograd into param.grad, the DDP hook into main_grad).
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step(increment=1)
        self.num_steps += 1
        return StepResult(ok=bool(ok), grad_norm=float(grad_norm or 0.0),
                          lr=self.optimizer.param_groups[0]["lr"])

    def turn_streamer(self, teacher, into=None):
        """Per-turn OPD on this learner (``learner.opd``): gradients accumulate, unnormalised, in
        DDP's buffers; ``finish_batch`` divides by Z once, then ``step`` as for RL. ``into``: a
        buffer (``backend.zeros()``) each backward pass is moved into instead -- opd_grpo, whose
        ledger uses DDP's buffers as scratch (``finish_opd_grpo_batch``)."""
        from megathunder.config import ConfigError
        from megathunder.learner.segment_model import MegatronSegmentModel
        from megathunder.streaming.opd_turns import TurnStreamer

        if self.cfg.opd is None:
            raise ConfigError("learner.opd: not set (per-turn OPD needs its strategy)")
        opd = self.cfg.opd
        self.ddp.zero_grad_buffer()
        seg = MegatronSegmentModel(self.ddp, self.groups)
        if into is not None:
            from megathunder.streaming.opd_grpo import IntoAccumulator

            seg = IntoAccumulator(seg, self.backend.live, into)
        return TurnStreamer(seg, teacher, beta=opd.beta,
                            strategy=opd.strategy, aggregation=opd.aggregation,
                            divergence=opd.divergence, jsd_lam=opd.jsd_lam)

    def finish_opd_batch(self, streamer) -> OPDBatchResult:
        """Divide the streamed OPD gradient by the batch's Z, counted over every data-parallel
        rank's trajectories (each rank streams only its own). Then ``step``."""
        result = self._opd_totals(streamer.finished_counts, streamer.divergence_sum, streamer.aggregation)
        streamer.finish_batch(result.normaliser)
        return result

    def opd_batch_gradient(self, batch: Sequence[Trajectory], teacher) -> OPDBatchResult:
        """OPD's batch-synchronous reference on this rank's trajectories (``loss_mask`` = trained
        tokens): the teacher scores each whole trajectory, one student forward and backward each,
        then one division by the batch's Z -- the gradient the per-turn streamer computes turn by
        turn (``megathunder.streaming.opd_turns`` derives why they are equal). Then ``step``."""
        from megathunder.learner.segment_model import MegatronSegmentModel
        from megathunder.streaming.opd_turns import accumulate_full_trajectory_gjsd, accumulate_full_trajectory_opd

        opd = self.cfg.opd
        gjsd = opd.divergence == "gjsd"
        items = []
        for traj in batch:
            score = teacher.score_log_softmax if gjsd else teacher.score
            items.append((traj.tokens, traj.loss_mask, score(traj.traj_id, traj.tokens, 1)))
            teacher.release(traj.traj_id)
        self.ddp.zero_grad_buffer()
        seg = MegatronSegmentModel(self.ddp, self.groups)
        if gjsd:
            counts, divergence = accumulate_full_trajectory_gjsd(seg, items, opd.beta, opd.jsd_lam)
        else:
            counts, divergence = accumulate_full_trajectory_opd(seg, items, opd.beta)
        result = self._opd_totals(counts, divergence, opd.aggregation)
        seg.divide_grads(result.normaliser)
        return result

    def finish_opd_grpo_batch(self, streamer, kl, z: float) -> OPDBatchResult:
        """opd_grpo under thunder, after ``ledger.close_batch`` (DDP's buffers = P / Z): add the
        streamed KL sum ``kl`` (``turn_streamer(teacher, into=kl)``) with the same Z, once --
        grad = (P + KL) / Z (``megathunder.streaming.opd_grpo``). Then ``step``."""
        self.backend.live.add_(kl, alpha=1.0 / z)
        metric = self._opd_totals(streamer.finished_counts, streamer.divergence_sum, streamer.aggregation)
        streamer.reset_counts()
        return OPDBatchResult(z, metric.divergence_mean)

    def opd_grpo_batch_gradient(self, batch: Sequence[Trajectory], rewards: Sequence[float],
                                owner: Sequence[int], teacher) -> OPDBatchResult:
        """opd_grpo's batch-synchronous reference: on this rank's trajectories the reward terms
        (``sync_step_gradient``'s schedule call) and the KL terms (``opd_batch_gradient``'s
        full-trajectory passes), unnormalised, then one division by the objective's Z
        (``batch_advantages``: trained tokens or trajectories of the whole batch). Then ``step``."""
        from megathunder.learner.segment_model import MegatronSegmentModel
        from megathunder.streaming.opd_turns import accumulate_full_trajectory_opd

        advantages, z = batch_advantages(batch, rewards, self.objective)
        self.ddp.zero_grad_buffer()
        mine = self._reward_terms(batch, advantages, owner)
        items = []
        for traj in (batch[i] for i in mine if batch[i].loss_mask.any()):
            items.append((traj.tokens, traj.loss_mask, teacher.score(traj.traj_id, traj.tokens, 1)))
            teacher.release(traj.traj_id)
        counts, divergence = accumulate_full_trajectory_opd(MegatronSegmentModel(self.ddp, self.groups),
                                                            items, self.cfg.opd.beta)
        self.backend.live.div_(z)
        return OPDBatchResult(z, self._opd_totals(counts, divergence, self.cfg.opd.aggregation).divergence_mean)

    def _opd_totals(self, counts: Sequence[int], divergence_sum: float, aggregation) -> OPDBatchResult:
        import torch.distributed as dist

        from megathunder.objectives.opd import opd_normaliser

        totals = torch.tensor([sum(counts), len(counts), divergence_sum], dtype=torch.float64,
                              device=self.groups.device)
        if self.groups.dims.dp > 1:
            dist.all_reduce(totals, group=self.groups.dp)
        num_tokens, num_trajs = int(totals[0]), int(totals[1])
        z = opd_normaliser([num_tokens] if aggregation == "token_mean" else [0] * num_trajs, aggregation)
        return OPDBatchResult(z, float(totals[2]) / max(num_tokens, 1))

    # ------------------------------------------------------------------ inference

    @torch.no_grad()
    def token_logprobs(self, trajs: Sequence[Trajectory], need_entropy: bool = False,
                       use_reference: bool = False) -> list[torch.Tensor] | None:
        """Per-target logprobs on the last pipeline stage (None on other stages)."""
        if not trajs:
            return []
        model = self.reference if use_reference else self.ddp
        offloaded = use_reference and next(model.parameters()).device != self.groups.device
        if offloaded:
            model.to(self.groups.device)
        out = run_schedule(model, self.groups, list(trajs), lambda k, logp, ent: logp.sum() * 0,
                           need_entropy=need_entropy, forward_only=True)
        if offloaded:
            model.to("cpu")
        if not self.groups.is_last_stage:
            return None
        return [d["logp"].cpu() for d in out]

    def fill_ref_logprobs(self, trajs: Sequence[Trajectory]) -> None:
        """Set each trajectory's ``ref_logprobs`` from the frozen reference (broadcast over PP)."""
        import torch.distributed as dist

        assert self.reference is not None, "no reference model: objective.kl_coef is 0"
        values = self.token_logprobs(trajs, use_reference=True)
        if self.groups.dims.pp > 1:
            box = [values]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.groups.pp, self.groups.dims.pp - 1),
                                       group=self.groups.pp)
            values = box[0]
        for t, v in zip(trajs, values, strict=True):
            t.ref_logprobs = v.to(t.rollout_logprobs.dtype if t.rollout_logprobs is not None else v.dtype)

    # ------------------------------------------------------------------ weights

    def export_hf(self, out_dir: str | Path) -> None:
        hf.export_hf(self.model, out_dir, self.model_cfg, self.groups, self.offset,
                     source_dir=self.cfg.model.hf_checkpoint, dtype=self.cfg.precision.params_dtype)

    def flat_params(self) -> torch.Tensor:
        """This rank's parameters (model chunk order), flattened -- for tests and probes."""
        return torch.cat([p.detach().reshape(-1).cpu() for p in self.model.parameters()])

    def num_loss_tokens(self, traj: Trajectory) -> int:
        return num_loss_tokens(traj, self.objective)
