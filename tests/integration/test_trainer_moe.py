"""A mixture-of-experts student end to end: the MoE quickstart (``configs/quickstart_moe.yaml``: a
tiny Qwen3-MoE, 4 experts, top-2) shortened to an SFT warm start and 3 GRPO steps on the thunder
schedule, with vLLM's CPU fused experts rolling out and Megatron's MoE layers learning, replaying
vLLM's routing (the quickstart's ``learner.moe.routing_replay``) and training the router losses
(per-sequence load balancing and z-loss, the ledger's reward-free terms; zero in the SFT warm start).
Checked: zero staleness after every
push (the probe: vLLM samples from the learner's experts), every trajectory's routing recorded for
every input position and kept in the journal, and the journal replayed through thunder (bit for
bit) and sync, in one process and at TP = 2 x EP = 2 (experts split over the two ranks, each
replaying its slice of the sequence), giving the live run's parameters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.test_trainer import ENV, ROOT, SMALL, UPDATE_RTOL, replay, rows, update_error, weights

EP2 = ["learner.parallel.tensor_parallel=2", "learner.parallel.sequence_parallel=true",
       "learner.parallel.expert_parallel=2"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("quickstart_moe")
    cmd = [sys.executable, "-m", "megathunder.cli", "train", str(ROOT / "configs/quickstart_moe.yaml"),
           f"run.output_dir={out}", *SMALL, "eval.every_n_steps=0", "run.num_steps=3", "sft.num_steps=8",
           "sft.batch_size=16", "run.wandb=disabled", "run.checkpoint_every=0",
           "learner.moe.load_balancing_type=seq_aux_loss", "learner.moe.aux_loss_coeff=0.01",
           "learner.moe.z_loss_coeff=0.001",
           "ledger.pack_ready_work=false"]  # held work depends on timing the journal does not record: bitwise replay
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def test_moe_quickstart_pushes_experts_and_probes_clean(moe_run):
    r = rows(moe_run)
    assert [x["step"] for x in r] == [0, 1, 2]
    assert all(x["policy_lag_max"] == 0 for x in r)
    assert all(0 <= x["probe_gap"] <= 1e-3 for x in r)  # measured 4.3e-6: vLLM holds the learner's experts
    assert all(0 <= x["probe_gap_own_routing"] <= 1e-3 for x in r)  # fp32: no routing flips on the tiny model
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in weights(moe_run / "final_model")


def test_moe_run_records_every_tokens_routing_in_the_journal(moe_run):
    """The engine's recorder saw every input position of every trajectory (a group's siblings share
    a cached prompt: its rows come from the request that computed it)."""
    from megathunder.trainer.journal import completed_steps

    steps = list(completed_steps(moe_run / "journal.jsonl"))
    assert [s for s, _, _ in steps] == [0, 1, 2]
    for _, entries, _ in steps:
        for e in entries:
            r = e.traj.routed_experts
            assert r is not None and r.shape == (e.traj.num_targets, 2, 2)  # 2 layers, top-2
            assert int(r.min()) >= 0 and int(r.max()) < 4  # recorded everywhere, 4 experts
            assert bool((r[..., 0] != r[..., 1]).all())  # two distinct experts per token


def test_moe_replay_through_thunder_and_sync_gives_the_live_parameters(moe_run, tmp_path):
    start, live = moe_run / "sft_model", moe_run / "final_model"
    replay(moe_run, tmp_path / "thunder", "thunder")
    replay(moe_run, tmp_path / "sync", "sync")
    a, b = weights(tmp_path / "thunder"), weights(live)
    assert all(torch.equal(a[k], b[k]) for k in b)  # the journal's event order: the same sums
    assert update_error(start, tmp_path / "sync", live) <= UPDATE_RTOL  # measured 8.5e-6


@pytest.mark.slow  # a two-rank replay; EP's streamed == batch == one process is tests/distributed/test_moe.py's
def test_moe_replay_with_expert_parallelism_gives_the_live_parameters(moe_run, tmp_path):
    start, live = moe_run / "sft_model", moe_run / "final_model"
    for mode in ("thunder", "sync"):
        replay(moe_run, tmp_path / mode, mode, 2, *EP2)
        assert update_error(start, tmp_path / mode, live) <= UPDATE_RTOL, mode  # measured 8.8e-6 / 9.4e-6


def test_moe_run_whose_last_turns_call_tools_routes_every_position(tmp_path):
    """The MoE quickstart stopped at GRPO step ~20 of 60: a trajectory whose one turn ended in a tool
    call had the tool's output appended after it, positions no engine request computed, so routing
    replay had no routing for them and the learner refused the trajectory. The calculator task's
    warm start makes tool calls the rule (its scripts call the calculator first), so with one turn
    the first step crosses that point several times: the run finishes, and every trajectory -- the
    ones ending in a tool call included (checked: some do) -- ends with the model's own last token,
    every input position routed."""
    from tokenizers import Tokenizer

    from megathunder.trainer.journal import completed_steps

    out = tmp_path / "calc"
    cmd = [sys.executable, "-m", "megathunder.cli", "train", str(ROOT / "configs/quickstart_moe.yaml"),
           f"run.output_dir={out}", *SMALL, "eval.every_n_steps=0", "run.num_steps=1", "sft.num_steps=8",
           "sft.batch_size=16", "run.wandb=disabled", "run.checkpoint_every=0", "task.name=calculator",
           "agent.max_turns=1", "agent.max_new_tokens_per_turn=48", "agent.max_total_tokens=700",
           "rollout.engine.max_model_len=1024"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    tok = Tokenizer.from_file(str(out / "init_model" / "tokenizer.json"))
    call, end = tok.token_to_id("<tool_call>"), tok.token_to_id("<|im_end|>")
    ended_in_a_call = 0
    for _, entries, _ in completed_steps(out / "journal.jsonl"):
        for e in entries:
            t = e.traj
            assert t.routed_experts is not None and int(t.routed_experts.min()) >= 0  # every position routed
            generated = t.tokens[1:][t.loss_mask].tolist()
            assert t.tokens[-1].item() == generated[-1]  # nothing after the model's last token
            ended_in_a_call += call in generated and generated[-1] == end
    assert ended_in_a_call > 0  # the case that stopped the quickstart happened


# MoE push + replay in process: the tests above; servers' push: tests/integration/test_chaos.py and test_vllm_engine.py
@pytest.mark.slow
def test_moe_on_a_rollout_server_pushes_experts_and_replays_its_routing(tmp_path):
    """The MoE student with its rollouts on a vLLM server (``rollout.engine.deployment=server``): experts
    pushed over the collective path, the server's routing read through ``/collective_rpc`` from the
    server that served each episode (session affinity), replayed by the learner."""
    from megathunder.trainer.journal import completed_steps

    out = tmp_path / "server"
    cmd = [sys.executable, "-m", "megathunder.cli", "train", str(ROOT / "configs/quickstart_moe.yaml"),
           f"run.output_dir={out}", *SMALL, "eval.every_n_steps=0", "run.num_steps=2", "sft.num_steps=2",
           "sft.batch_size=8", "run.wandb=disabled", "run.checkpoint_every=0",
           "rollout.engine.deployment=server", "rollout.engine.base_port=18530"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = rows(out)
    assert [x["step"] for x in r] == [0, 1] and all(x["policy_lag_max"] == 0 for x in r)
    assert all(0 <= x["probe_gap"] <= 1e-3 and 0 <= x["probe_gap_own_routing"] <= 1e-3 for x in r)
    for _, entries, _ in completed_steps(out / "journal.jsonl"):
        assert all(e.traj.routed_experts is not None and int(e.traj.routed_experts.min()) >= 0 for e in entries)
