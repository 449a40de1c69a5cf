"""Resumable learner checkpoints with ``megatron.core.dist_checkpointing`` (torch_dist format).

One directory per step: the model's and the optimizer's sharded state (so a checkpoint saved with
one TP x PP layout loads into another), the LR scheduler and the step count. No RNG state: the
learner draws no random numbers (dropout is 0 in every layer it builds, ``learner/model.py``;
sampling is vLLM's, seeded per request from ``run.seed`` and the step), so a resumed run computes
what the uninterrupted one would have. Writing goes to ``step_N.tmp`` and is renamed to ``step_N``
only when every rank has finished, so a crash mid-save never leaves a directory that looks
complete; ``latest`` names the newest. Before the first optimizer step there is nothing to save
(``save_checkpoint``).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megathunder.diskspace import replace_text, writing
from megathunder.learner.checkpoint_writer import forked_results_queue
from megathunder.learner.learner import MegatronLearner

# The optimizer state layout that reshards across TP/PP/DP (Megatron's "fully reshardable").
_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded_state(learner: MegatronLearner, is_loading: bool) -> dict:
    model_sd = learner.model.sharded_state_dict()
    return {
        "model": model_sd,
        "optimizer": learner.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                          metadata=_OPTIM_METADATA),
    }


def _materialise_optimizer_state(optimizer) -> None:
    """A fresh distributed optimizer has no Adam state yet, and without TE/Apex Megatron's
    ``state_dict`` needs one (its step count): create placeholder state (one zero-gradient step of
    the inner optimizer) that the checkpoint then overwrites, as Megatron does for FSDP."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if hasattr(opt, "_init_optimizer_states_with_dummy_values") and inner is not None and not inner.state:
            opt._init_optimizer_states_with_dummy_values()


@contextlib.contextmanager
def _adam_step_kept_out_of_param_state(optimizer):
    """megatron-core 0.16 without TE/Apex (torch Adam): loading a fully reshardable distributed
    optimizer state copies every per-parameter state key from the checkpoint, but torch Adam's
    ``step`` is stored per parameter group (and restored from there); keep it out of that copy
    (tests/distributed: resume with the distributed optimizer is bit-exact)."""
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        original = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if original is None:
            continue

        def without_step(model_param, tensors, opt=opt, original=original):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
            step = state.pop("step", None) if "step" not in tensors else None
            try:
                original(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        opt._set_main_param_and_optimizer_states = without_step
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states
    # ... and it restores that step as one tensor shared by every parameter's state, which torch
    # Adam then increments in place once per parameter: give each state its own.
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def save_checkpoint(learner: MegatronLearner, root: str | Path) -> Path | None:
    """The learner's state as ``root/step_N`` (N: its optimizer steps), or None before its first
    step: the weights are then the initial model's, which the same command builds again, and
    Megatron's distributed optimizer has no state to write (its ``state_dict`` asserts a step)."""
    from megatron.core import dist_checkpointing

    if learner.num_steps == 0:
        return None
    forked_results_queue()
    root = Path(root)
    final = root / f"step_{learner.num_steps}"
    tmp = root / f"step_{learner.num_steps}.tmp"
    last = latest_checkpoint(root)
    detail = f" (checkpoint {final.name}; the last complete one, {last.name if last else 'none'}, is intact)"
    state = _sharded_state(learner, is_loading=False)  # before anything is written: it may refuse
    state["scheduler"] = learner.scheduler.state_dict()
    state["num_steps"] = learner.num_steps
    if learner.pgs.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        with writing(tmp, detail):
            tmp.mkdir(parents=True)
    dist.barrier()
    try:
        with writing(tmp, detail):
            dist_checkpointing.save(state, str(tmp), content_metadata=_OPTIM_METADATA)
    except BaseException:
        if learner.pgs.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # frees what it took; `latest` still names the last one
        raise
    dist.barrier()
    if learner.pgs.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        replace_text(root / "latest", final.name + "\n")  # atomic: a full disk cannot leave it empty
    dist.barrier()
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    marker = Path(root) / "latest"
    if not marker.is_file():
        return None
    path = Path(root) / marker.read_text().strip()
    return path if path.is_dir() else None


def load_checkpoint(learner: MegatronLearner, path: str | Path, load_optimizer: bool = True) -> None:
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if load_optimizer:
        _materialise_optimizer_state(learner.optimizer)
    state = _sharded_state(learner, is_loading=True)
    if not load_optimizer:
        del state["optimizer"]
    state["scheduler"] = learner.scheduler.state_dict()
    state["num_steps"] = 0
    if load_optimizer:
        _check_optimizer_kind(state["optimizer"], path)
    loaded = dist_checkpointing.load(state, str(path))
    learner.model.load_state_dict(loaded["model"], strict=False)
    if load_optimizer:
        with _adam_step_kept_out_of_param_state(learner.optimizer):
            learner.optimizer.load_state_dict(loaded["optimizer"])
    learner.scheduler.load_state_dict(loaded["scheduler"])
    learner.num_steps = int(loaded["num_steps"])
    if learner.reference is not None and learner.num_steps == 0:
        learner.reference.load_state_dict(learner.model.state_dict(), strict=False)
    torch.distributed.barrier()


def _check_optimizer_kind(optimizer_state: dict, path: Path) -> None:
    """megatron-core 0.16 keeps a MoE's expert parameters in an optimizer of their own (a
    ChainedOptimizer: keys ``chained_0.`` / ``chained_1.``) only under expert parallelism, and cannot
    load one kind of state into the other: say so by field instead of Megatron's KeyError."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    ours = any(str(getattr(v, "key", "")).startswith("chained_") for v in nested_values(optimizer_state))
    saved_keys = [k for k in dist_checkpointing.load_tensors_metadata(str(path)) if ".optimizer." in f".{k}"]
    saved = any(k.startswith("chained_") for k in saved_keys)
    if saved_keys and ours != saved:
        raise ValueError(
            f"checkpoint {path}: its optimizer state was saved with learner.parallel.expert_parallel "
            f"{'> 1' if saved else '= 1'} (dense and expert optimizers {'chained' if saved else 'as one'}) and this "
            f"learner has expert_parallel {'> 1' if ours else '= 1'}; megatron-core 0.16 does not reshard between "
            "the two: resume with expert_parallel on the same side of 1 (any such layout), or load the weights only")
