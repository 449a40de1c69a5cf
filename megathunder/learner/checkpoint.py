"""Resumable learner checkpoints with ``megatron.core.dist_checkpointing`` (torch_dist format).

One directory per step: the model's and the optimizer's sharded state (so a checkpoint saved with
one TP x PP layout loads into another), the LR scheduler, the step count and the RNG state.
Writing goes to ``step_N.tmp`` and is renamed to ``step_N`` only when every rank has finished,
so a crash mid-save never leaves a directory that looks complete; ``latest`` names the newest.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

# The optimizer state layout that reshards across TP/PP/DP (Megatron's "fully reshardable").
_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded_state(learner, is_loading: bool) -> dict:
    model_sd = learner.model.sharded_state_dict()
    return {
        "model": model_sd,
        "optimizer": learner.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                          metadata=_OPTIM_METADATA),
    }


def save_checkpoint(learner, root: str | Path) -> Path:
    from megatron.core import dist_checkpointing

    root = Path(root)
    final = root / f"step_{learner.num_steps}"
    tmp = root / f"step_{learner.num_steps}.tmp"
    if learner.groups.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = _sharded_state(learner, is_loading=False)
    state["scheduler"] = learner.scheduler.state_dict()
    state["num_steps"] = learner.num_steps
    dist_checkpointing.save(state, str(tmp), content_metadata=_OPTIM_METADATA)
    dist.barrier()
    if learner.groups.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (root / "latest").write_text(final.name + "\n")
    dist.barrier()
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    marker = Path(root) / "latest"
    if not marker.is_file():
        return None
    path = Path(root) / marker.read_text().strip()
    return path if path.is_dir() else None


def _prepare_distributed_optimizer(optimizer) -> None:
    """Let a fresh process's DistributedOptimizer (torch Adam, no apex / TE) load a checkpoint.

    Megatron 0.16 builds the optimizer's state dict from the inner optimizer's per-parameter state
    (``assert len(steps) == 1`` on its 'step' entries), which exists only after a first step:
    its own helper takes one on zero gradients (the values are then replaced by the checkpoint's).
    Loading then restores 'step' from the param groups and copies every per-parameter entry,
    'step' included, from the checkpoint's parameter state, which holds no 'step': the copy is
    limited to the entries the checkpoint has, and each parameter gets its own 'step' tensor
    (Megatron gives all of them one, which torch's Adam would increment once per parameter). (Seen on the first requeued DP=2 trainer run.)
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None or not hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            continue  # not a DistributedOptimizer
        if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            continue  # TE's optimizer: its own state handling
        if not inner.state:
            opt._init_optimizer_states_with_dummy_values()
        opt._set_main_param_and_optimizer_states = functools.partial(_set_saved_states, opt)


def _set_saved_states(opt, model_param, tensors: dict) -> None:
    group_index, group_order = opt.model_param_group_index_map[model_param]
    main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
    state = opt.optimizer.state[main_param]
    if "step" in state:  # Megatron set one tensor for all parameters; torch Adam increments each in place
        state["step"] = state["step"].clone()
    dst = {"param": main_param, **state}
    for key, value in tensors.items():
        dst[key].copy_(value)


def load_checkpoint(learner, path: str | Path, load_optimizer: bool = True) -> None:
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if load_optimizer:
        _prepare_distributed_optimizer(learner.optimizer)
    state = _sharded_state(learner, is_loading=True)
    if not load_optimizer:
        del state["optimizer"]
    state["scheduler"] = learner.scheduler.state_dict()
    state["num_steps"] = 0
    loaded = dist_checkpointing.load(state, str(path))
    learner.model.load_state_dict(loaded["model"], strict=False)
    if load_optimizer:
        learner.optimizer.load_state_dict(loaded["optimizer"])
    learner.scheduler.load_state_dict(loaded["scheduler"])
    learner.num_steps = int(loaded["num_steps"])
    if learner.reference is not None and learner.num_steps == 0:
        learner.reference.load_state_dict(learner.model.state_dict(), strict=False)
    torch.distributed.barrier()
