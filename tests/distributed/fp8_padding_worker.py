"""One rank of the FP8-padding check (``test_fp8_padding.py``): the batch-synchronous gradient and token
logprobs with trajectories padded to the layout's own multiple, then to the FP8 multiple (the
``token_align`` an FP8 run gets, forced here with FP8 off: CPUs have no FP8 GEMMs), from the same
weights; the padded lengths each call used and the DP-reduced gradients, saved by rank 0.

    worker --hf DIR --out FILE [--tp N] [--learner JSON]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megathunder.config import GRPOObjective, LearnerConfig, LedgerConfig  # noqa: E402
from megathunder.learner.batches import grpo_gradient  # noqa: E402
from megathunder.learner.learner import MegatronLearner  # noqa: E402
from megathunder.learner.parallel import destroy_distributed, from_last_stage, init_distributed  # noqa: E402
from tests.distributed.learner_worker import _merge, full_params, make_batch  # noqa: E402

OBJECTIVE = '{"kl_coef": 0.0, "entropy_coef": 0.01, "advantage": "rloo", "loss_agg": "seq_mean_token_mean"}'


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--learner", default="{}")
    args = p.parse_args()
    from megatron.core.distributed import finalize_model_grads

    cfg = LearnerConfig.model_validate(_merge({
        "parallel": {"tensor_parallel": args.tp},
        "model": {"hf_checkpoint": args.hf},
        "optimizer": {"name": "sgd", "lr": 1.0, "clip_grad": 0.0, "use_distributed_optimizer": False},
    }, json.loads(args.learner)))
    pgs = init_distributed(cfg)
    learner = MegatronLearner.build(cfg, GRPOObjective.model_validate_json(OBJECTIVE), pgs,
                                    LedgerConfig(max_group_slots=0))
    batch, rewards, _ = make_batch(0, learner.model_cfg.vocab_size)
    owner = [t.traj_id % pgs.dims.dp for t in batch]
    passes = learner.forward_backward
    widths: list[int] = []
    layout = passes._layout

    def recorded(items, **kwargs):  # every schedule call's padded lengths
        out = layout(items, **kwargs)
        widths.extend(out.lengths if hasattr(out, "lengths") else [w for _, w in out.batches])  # shared rows
        return out

    passes._layout = recorded
    out: dict = {}
    for name, align in (("own", 1), ("fp8", 16)):
        passes.pgs = dataclasses.replace(pgs, dims=dataclasses.replace(pgs.dims, token_align=align))
        widths.clear()
        out[f"{name}_logp"] = from_last_stage(pgs, learner.token_logprobs(batch))
        grpo_gradient(learner, batch, rewards, owner)
        finalize_model_grads([learner.ddp], None, pg_collection=pgs.collection)  # the DP sum, as ``step``
        out[f"{name}_grad"] = full_params(learner, "main_grad")
        out[f"{name}_widths"] = sorted(set(widths))
        out[f"{name}_multiple"] = passes.pgs.dims.seq_multiple
    out["num_targets"] = sorted({t.num_targets for t in batch})
    if pgs.rank == 0:
        torch.save(out, args.out)
    destroy_distributed()


if __name__ == "__main__":
    main()
