"""``megathunder bench chaos``'s plan: every kind it draws is a valid ``chaos.faults`` entry of its
deployment, the engine faults inside a weight update included (they stop the run: resumed), and each
run's command line -- the config it trains and its overrides -- validates as it is run (the tool
faults' terminal task once inherited the quickstart's arithmetic fields and every such run was
refused at parse time)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from megathunder.bench.chaos_soak import KINDS, ROOT, STALL, UPDATE_KINDS, plan
from megathunder.config import load_config


def test_every_kind_drawn_is_a_valid_fault_of_its_deployment(tmp_path: Path):
    kinds = [k for k in KINDS if k != "fill_disk" or os.geteuid() == 0]  # fill_disk mounts a tmpfs: root only
    args = argparse.Namespace(seed=5, kinds=list(KINDS), runs=2 * len(kinds), steps=2, sft_steps=4, overrides=[],
                              base_port=31000, config=str(ROOT / "configs/quickstart.yaml"))
    refs, runs = plan(args, tmp_path)
    assert sorted(r.kind for r in runs) == sorted(2 * kinds)  # in rounds: each kind twice
    for run in runs:
        cfg = load_config(str(run.config or args.config), [f"run.output_dir={run.out}", *run.overrides])
        [fault] = cfg.chaos.faults
        if run.kind in ("hang_sandbox", "oom_tool"):
            assert cfg.task.name == "terminal"
        if run.kind in UPDATE_KINDS:
            assert (fault.kind, fault.during) == (run.kind.removesuffix("_update"), "weight_update")
            assert run.deployment == "in_process" and fault.step < 2
        if run.kind in ("hang_engine", "hang_engine_update"):
            assert set(STALL) <= set(run.overrides)
    assert refs[0].kind == "none"


def test_a_claim_that_compares_a_zero_update_is_lost_not_kept(tmp_path: Path):
    """A run whose step trained nothing (every group's rewards equal, no other term) equals any
    reference: the soak calls it lost ("vacuous") instead of counting it as a claim kept."""
    import torch
    from safetensors.torch import save_file

    from megathunder.bench.chaos_soak import FAULT_FREE_CLAIM, Run, compare

    w0 = {"w": torch.ones(4)}
    for name, w in (("sft_model", w0), ("final_model", w0), ("reference/final_model", w0)):
        (tmp_path / name).mkdir(parents=True)
        save_file(w, str(tmp_path / name / "model.safetensors"))
    kind = sorted(FAULT_FREE_CLAIM)[0]
    run = Run(2, kind, {}, "in_process", tmp_path, [], outcome="survived")
    compare(run, tmp_path / "reference", argparse.Namespace())
    assert run.outcome == "lost" and run.error.startswith("vacuous"), run
    save_file({"w": torch.full((4,), 2.0)}, str(tmp_path / "reference/final_model/model.safetensors"))
    save_file({"w": torch.full((4,), 2.0)}, str(tmp_path / "final_model/model.safetensors"))
    run = Run(2, kind, {}, "in_process", tmp_path, [], outcome="survived")
    compare(run, tmp_path / "reference", argparse.Namespace())
    assert run.outcome == "survived" and run.update_rel == 0.0
