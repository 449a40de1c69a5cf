"""``MegatronLearner``: the policy (Megatron GPTModel in DDP), its optimizer and LR schedule, the
gradient ledger on DDP's buffers, and the frozen reference model.

    learner = MegatronLearner.build(cfg, objective, pgs, ledger_cfg, hf_dir)
    batch = new_batch(learner, teacher, plan, streamed)   # megathunder.learner.batches: the gradient
    ...events...; batch.close(); learner.step()            # one DP reduce + optimizer step per batch
    (megathunder.learner.push)                             # the weight push, stage by stage

A batch (``megathunder.learner.batches``) leaves this rank's share of (1/Z) sum_i grad loss_i in
DDP's buffers (``gradients``); ``step`` reduces it across data-parallel ranks (a sum) and steps.
Every pass over whole trajectories -- the ledger's (``backend``), the batch-synchronous gradients,
SFT's, the logprobs -- is a call of the one ``forward_backward``
(``megathunder.learner.forward_backward``), built here with the learner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megathunder.config import ConfigError, LearnerConfig, LedgerConfig, ObjectiveConfig, PolicyModelConfig, RLObjective
from megathunder.learner import checkpoint_writer, hf
from megathunder.learner.backend import MegatronBackend
from megathunder.learner.forward_backward import ForwardBackward, GradientSpace
from megathunder.learner.model import build_gpt_model, layer_offset, resolve_model_config
from megathunder.learner.parallel import ProcessGroups, from_last_stage
from megathunder.learner.segment_model import MegatronSegmentModel
from megathunder.objectives import num_loss_tokens
from megathunder.streaming import GradientLedger
from megathunder.trajectory import Trajectory


@dataclass(frozen=True)
class StepResult:
    ok: bool
    grad_norm: float
    lr: float


class MegatronLearner:
    def __init__(self, cfg: LearnerConfig, model_cfg: PolicyModelConfig, objective: ObjectiveConfig,
                 pgs: ProcessGroups, model: torch.nn.Module, ddp: DistributedDataParallel,
                 optimizer: MegatronOptimizer, scheduler: OptimizerParamScheduler,
                 ledger_cfg: LedgerConfig | None = None, reference: torch.nn.Module | None = None,
                 hf_dir: Path | None = None, temperature: float = 1.0) -> None:
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.objective = objective
        self.pgs = pgs
        self.model = model
        self.ddp = ddp
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.offset = layer_offset(model_cfg, pgs)
        rl = objective if isinstance(objective, RLObjective) else None  # the reward part, if any
        self.temperature = temperature  # rollout.temperature: the policy trained is softmax(z / T), what vLLM samples
        # MoE router losses (learner.moe): reward-free terms of the model's own, carried by the ledger
        self.router_losses = model_cfg.is_moe and cfg.moe.router_losses
        self.gradients = GradientSpace(ddp)  # DDP's buffers, as the batches see them
        self.forward_backward = ForwardBackward.build(ddp, pgs, cfg, temperature)  # every whole-trajectory pass
        self.backend = MegatronBackend(self.forward_backward, self.gradients, rl, self.router_losses)
        self.ledger = (GradientLedger(self.backend, rl, ledger_cfg, model_reward_free=self.router_losses,
                                      dp_group=pgs.dp if pgs.dims.data_units > 1 else None,
                                      dp_copies=pgs.dims.expert_span)
                       if rl is not None else None)
        self.reference = reference
        self.hf_dir = hf_dir  # the Hugging Face directory the weights came from (tokenizer, config)
        self.num_steps = 0

    @classmethod
    def build(cls, cfg: LearnerConfig, objective: ObjectiveConfig, pgs: ProcessGroups,
              ledger_cfg: LedgerConfig | None = None, hf_dir: str | Path | None = None,
              temperature: float = 1.0) -> MegatronLearner:
        """The learner of ``cfg`` with weights from ``hf_dir`` (default ``cfg.model.hf_checkpoint``;
        random weights of ``cfg.model``'s sizes when neither is set). ``temperature``: the rollout's
        sampling temperature; every logprob the learner computes is of softmax(logits / T)."""
        hf_dir = Path(hf_dir) if hf_dir is not None else (
            Path(cfg.model.hf_checkpoint) if cfg.model.hf_checkpoint is not None else None)
        checkpoint_writer.start_results_queue()  # before the model: a manager forked later holds its memory
        model_cfg = resolve_model_config(cfg.model, hf_dir)
        if pgs.dims.expert_span > 1 and objective.kind != "grpo":
            raise ConfigError(f"learner.parallel.expert_parallel: an expert grid spanning data-parallel ranks trains "
                              f"objective.kind grpo only (data-parallel units), not {objective.kind}")
        if model_cfg.is_moe and cfg.moe.router_losses and objective.kind != "grpo":
            raise ConfigError(f"learner.moe.aux_loss_coeff / z_loss_coeff: router losses are trained as reward-free "
                              f"terms of the GRPO ledger (objective.kind grpo), not under objective.kind "
                              f"{objective.kind}; set them to 0")
        model = build_gpt_model(model_cfg, cfg.precision, pgs, cfg.activations, cfg.moe)
        offset = layer_offset(model_cfg, pgs)
        if hf_dir is not None:
            hf.load_hf(model, hf_dir, model_cfg, pgs, offset)  # this rank's slices only
        opt = cfg.optimizer
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=opt.use_distributed_optimizer,
            average_in_collective=False,
        )
        ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model,
                                      pg_collection=pgs.collection)
        bf16 = cfg.precision.params_dtype == "bfloat16"
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer=opt.name, lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
                adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
                sgd_momentum=opt.sgd_momentum, clip_grad=opt.clip_grad, use_distributed_optimizer=opt.use_distributed_optimizer,
                bf16=bf16, params_dtype=model.config.params_dtype,
            ),
            [ddp],
            use_gloo_process_groups=False,
            pg_collection=pgs.collection,
        )
        if opt.name == "sgd":  # megatron-core 0.16 has no state initialiser for SGD: a checkpoint would not load
            for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
                inner.init_state_fn = _init_sgd_state
        if pgs.device.type == "cpu":
            _fused_torch_adam(optimizer)
        decay_steps = opt.lr_decay_steps or max(opt.lr_warmup_steps + 1, 1)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if opt.lr_warmup_steps else opt.lr, max_lr=opt.lr, min_lr=opt.min_lr,
            lr_warmup_steps=opt.lr_warmup_steps, lr_decay_steps=max(decay_steps, opt.lr_warmup_steps + 1),
            lr_decay_style=opt.lr_decay_style, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
            wd_incr_steps=1, wd_incr_style="constant",
        )
        reference = None
        if isinstance(objective, RLObjective) and objective.kl_coef > 0:  # a frozen copy of the initial policy
            # the reference routes by itself: the engine's routing is the current policy's, not its own
            reference = build_gpt_model(model_cfg, cfg.precision, pgs, moe=cfg.moe.model_copy(update={
                "routing_replay": False, "aux_loss_coeff": 0.0, "z_loss_coeff": 0.0}))  # forward-only
            reference.load_state_dict(model.state_dict(), strict=False)
            reference.requires_grad_(False).eval()
            if cfg.reference.offload_to_cpu and pgs.device.type == "cuda":
                reference.to("cpu")
        return cls(cfg, model_cfg, objective, pgs, model, ddp, optimizer, scheduler, ledger_cfg, reference, hf_dir,
                   temperature)

    # ------------------------------------------------------------------ gradients

    def step(self, advance_schedule: bool = True) -> StepResult:
        """Reduce the gradient in DDP's buffers across data-parallel ranks once, then step.
        ``advance_schedule=False``: a PPO mini-batch's step inside a batch (the learning rate and
        the step count advance once per batch)."""
        span = self.pgs.dims.expert_span
        if span > 1:  # an expert grid across DP ranks: every unit's gradient is there k times (parallel.py)
            for grad in self.gradients.live.tensors:
                grad.mul_(1.0 / span)
        finalize_model_grads([self.ddp], None, pg_collection=self.pgs.collection)
        ok, grad_norm, _ = self.optimizer.step()
        # The optimizer aliased param.grad to main_grad; a later backward would then add each
        # gradient twice (autograd into param.grad, the DDP hook into main_grad).
        self.optimizer.zero_grad(set_to_none=True)
        if advance_schedule:
            self.scheduler.step(increment=1)
            self.num_steps += 1
        return StepResult(ok=bool(ok), grad_norm=float(grad_norm or 0.0),
                          lr=self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ inference

    @torch.no_grad()
    def token_logprobs(self, trajs: Sequence[Trajectory], need_entropy: bool = False,
                       use_reference: bool = False, temperature: float | None = None) -> list[torch.Tensor] | None:
        """Per-target logprobs at the sampling temperature (or ``temperature``: the probe's 1) on the
        last pipeline stage (None on other stages); the reference model's too (a KL between the two
        tempered policies)."""
        if not trajs:
            return []
        if use_reference:
            assert self.reference is not None, "no reference model: objective.kl_coef is 0"
            model = self.reference
        else:
            model = self.ddp
        offloaded = use_reference and next(model.parameters()).device != self.pgs.device
        if offloaded:
            model.to(self.pgs.device)
        reports = self.forward_backward.forward(trajs, model=model, temperature=temperature, need_entropy=need_entropy)
        if offloaded:
            model.to("cpu")
        if not self.pgs.is_last_stage:
            return None
        return [d["logp"].cpu() for d in reports]

    def segments(self) -> MegatronSegmentModel:
        """The policy as the per-turn streamer's ``SegmentModel`` (segment forwards on past K/V,
        backward passes into DDP's buffers): OPD's and GRPO's per-turn passes."""
        return MegatronSegmentModel(self.ddp, self.pgs, self.temperature)

    def fill_ref_logprobs(self, trajs: Sequence[Trajectory]) -> None:
        """Set each trajectory's ``ref_logprobs`` from the frozen reference (every PP stage)."""
        assert self.reference is not None, "no reference model: objective.kl_coef is 0"
        values = from_last_stage(self.pgs, self.token_logprobs(trajs, use_reference=True))
        for t, v in zip(trajs, values, strict=True):
            t.ref_logprobs = v.to(t.rollout_logprobs.dtype if t.rollout_logprobs is not None else v.dtype)

    # ------------------------------------------------------------------ weights

    def export_hf(self, out_dir: str | Path) -> None:
        """The weights as a Hugging Face directory (tokenizer and config copied from ``hf_dir``)."""
        hf.export_hf(self.model, out_dir, self.model_cfg, self.pgs, self.offset,
                     source_dir=self.hf_dir, dtype=self.cfg.precision.params_dtype)

    def flat_params(self) -> torch.Tensor:
        """This rank's parameters (model chunk order), flattened -- for tests and probes."""
        return torch.cat([p.detach().reshape(-1).cpu() for p in self.model.parameters()])

    def num_loss_tokens(self, traj: Trajectory) -> int:
        """The trajectory's size in the reward part's normaliser (``objective.loss_agg``)."""
        if not isinstance(self.objective, RLObjective):
            raise TypeError(f"objective.kind={self.objective.kind} has no reward part")
        return num_loss_tokens(traj, self.objective)


def _fused_torch_adam(optimizer: object) -> None:
    """Without Transformer Engine or Apex megatron-core steps with ``torch.optim.Adam(W)``, which on
    CPU tensors defaults to its single-tensor loop: a dozen elementwise passes over every parameter,
    one tensor at a time (1.2-1.9 s of a SmolLM2-135M step here). Its fused CPU kernel does the same
    update in one vectorised pass per tensor; same formula, rounding of the fused arithmetic."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(inner, "optimizer", None)
        if isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):
            for group in torch_opt.param_groups:
                group["foreach"], group["fused"] = False, True
            torch_opt.defaults.update(foreach=False, fused=True)


def _init_sgd_state(opt: torch.optim.Optimizer, config: object = None) -> None:
    """SGD's state before a checkpoint is loaded into it: a zero momentum buffer per parameter, the
    buffer torch's SGD makes at its first step (``buf = grad`` = momentum * 0 + grad)."""
    for group in opt.param_groups:
        if group.get("momentum", 0) == 0:
            continue
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p.data)
