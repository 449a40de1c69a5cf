"""Mixture-of-experts students on the Megatron learner (CPU, gloo): a Qwen3-MoE checkpoint in and out
bit for bit, its logprobs against transformers, and the streamed (thunder) gradient against the batch
gradient under expert parallelism (inside TP and across DP ranks), expert-tensor parallelism, PP and DP,
against one process; the router losses (per-sequence aux and z) streamed exactly; routing replay; a MoE
learner's checkpoint resumed bit for bit.

Routing is discrete: a token whose k-th and (k+1)-th router logits are within rounding of each other
could be sent to different experts by two summation orders (layouts), which is an O(1) change of that
token's output rather than a rounding difference. The fixture's routers are drawn wide (std 1.0), and
``test_routers_are_far_from_ties`` checks on the very trajectories the other tests use that every
top-k boundary is at least ``ROUTER_GAP`` away -- more than 1000x the fp32 rounding of those logits
(|logit| <= ~20, hidden size 32: ~20 * 32 * 6e-8 ~ 4e-5 worst case) -- so every layout routes every
token alike and the comparisons below are of rounding only.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.conftest import launch

ROUTER_GAP = 1e-2  # measured minimum on these trajectories: 3.9e-2 (Qwen3-MoE), 1.6e-2 (Mixtral)

MOE_GRAD_TOL = 5e-6
"""fp32, relative to the gradient's norm. One process: streamed vs sync 6.7e-7; every layout vs one
process at most 1.2e-6 (TP=2 with SP and expert-tensor parallelism), almost all of it in the
embedding's gradient, which sums every layer's reassociation (SP's reduce-scatters, the experts'
all-gather and reduce-scatter of tokens). That is 2-4x the dense model's (2.5e-7 .. 1e-6): the wide
routers, which keep routing away from ties, also scale the softmax Jacobian. The bound is 4x the largest
observation; a single token routed differently moves the gradient by ~1e-2 (orders above)."""

LOGPROB_ATOL = 2e-6  # as the dense tests: measured 4.8e-7 .. 9.5e-7 for the MoE

EP2 = {"parallel": {"tensor_parallel": 2, "sequence_parallel": True, "expert_parallel": 2}}
ETP2 = {"parallel": {"tensor_parallel": 2, "sequence_parallel": True, "expert_tensor_parallel": 2}}
LAYOUTS = {  # name: (ranks, learner config, expert-parallel buffers expected)
    "ep2": (2, EP2, True),
    "etp2": (2, ETP2, False),
    "pp2": (2, {"parallel": {"pipeline_parallel": 2}}, False),
    "dp2": (2, {}, False),
    "tp2_ep2_dp2": (4, EP2, True),
    "dp2_ep2": (2, {"parallel": {"expert_parallel": 2}}, True),  # the expert grid spans the two DP ranks
    "tp2_dp2_ep2_etp2": (4, {"parallel": {"tensor_parallel": 2, "sequence_parallel": True, "expert_parallel": 2,
                                          "expert_tensor_parallel": 2}}, True),  # a 2 x 2 grid over 2 DP ranks
}


def _flat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([d[k].reshape(-1).double() for k in sorted(d)])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_routers_are_far_from_ties(request, family):
    import transformers

    from tests.distributed.learner_worker import make_batch

    model = transformers.AutoModelForCausalLM.from_pretrained(request.getfixturevalue(f"hf_{family}")).float()
    logits: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda mod, inp, out: logits.append(out[0]))
    k = model.config.num_experts_per_tok
    for seed in (0, 3):  # the equivalence batch and the logprob batch
        batch, _, _ = make_batch(seed, model.config.vocab_size)
        with torch.no_grad():
            for traj in batch:
                model(traj.tokens[None])
    top = torch.cat(logits).sort(dim=-1, descending=True).values
    gap = (top[:, k - 1] - top[:, k]).min().item()
    assert gap > ROUTER_GAP, gap
    assert top.abs().max() < 40  # the rounding estimate above assumes logits of this size


@pytest.mark.parametrize("family,expert_tensor", [
    ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w2.weight"),
    ("qwen2_moe", "model.layers.1.mlp.shared_expert_gate.weight")])
def test_other_families_import_export_bit_exact_and_match_transformers_at_tp2_ep2(request, tmp_path, family,
                                                                                  expert_tensor):
    """Mixtral: block_sparse_moe.gate / experts.e.{w1,w3,w2} are the same router and experts under
    other names (top-k always renormalised, no q/k norms). Qwen2-MoE: a shared expert,
    mlp.shared_expert.{gate,up,down}_proj (TP-sharded as a dense MLP), whose output
    sigmoid(mlp.shared_expert_gate . x) scales -- Megatron's shared experts with
    ``moe_shared_expert_gate`` -- and a router taking the top-k of the softmax without renormalising.
    TP=2 x EP=2 with SP: every rank its slices."""
    from megathunder.learner.safetensors_io import load_dir
    from tests.distributed.test_learner import _assert_logprobs_match_transformers

    source = request.getfixturevalue(f"hf_{family}")
    export, out = tmp_path / "export", tmp_path / "rt.pt"
    launch(2, "hf_roundtrip", "--out", str(out), "--hf", str(source), "--export", str(export),
           "--learner", json.dumps(EP2))
    original, exported = load_dir(source), load_dir(export)
    assert sorted(original) == sorted(exported) and expert_tensor in exported
    assert all(torch.equal(original[k], exported[k]) for k in original)
    _assert_logprobs_match_transformers(export, torch.load(out)["logprobs"])


def test_qwen2_moe_streamed_equals_sync_at_tp2_ep2(hf_qwen2_moe, tmp_path):
    """The shared expert and its gate are dense parameters to the ledger: streamed == batch."""
    out = tmp_path / "eq.pt"
    launch(2, "equivalence", "--out", str(out), "--hf", str(hf_qwen2_moe), "--optimizer", "sgd",
           "--learner", json.dumps(EP2))
    r = torch.load(out)
    assert any("shared_expert" in k for k in r["stream_grad"])
    assert _rel(_flat(r["stream_grad"]), _flat(r["sync_grad"])) <= MOE_GRAD_TOL


@pytest.mark.parametrize("ranks,learner", [(1, {}), (4, {"parallel": {
    "tensor_parallel": 2, "pipeline_parallel": 2, "sequence_parallel": True, "expert_parallel": 2}}),
    (2, {"parallel": {"expert_parallel": 2}})],
    ids=["one_process", "tp2_pp2_ep2", "dp2_ep2"])
def test_moe_hf_roundtrip_is_bit_exact_and_logprobs_match_transformers(hf_qwen3_moe, tmp_path, ranks, learner):
    """Each rank reads only its experts (and its slices); the export gathers every expert of a stage
    onto its TP rank 0 and writes one tensor per expert, as the checkpoint had them."""
    from megathunder.learner.safetensors_io import load_dir
    from tests.distributed.test_learner import _assert_logprobs_match_transformers

    export, out = tmp_path / "export", tmp_path / "rt.pt"
    launch(ranks, "hf_roundtrip", "--out", str(out), "--hf", str(hf_qwen3_moe), "--export", str(export),
           "--learner", json.dumps(learner))
    original, exported = load_dir(hf_qwen3_moe), load_dir(export)
    assert sorted(original) == sorted(exported)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in exported
    assert all(torch.equal(original[k], exported[k]) for k in original)
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"  # copied from the source (transformers names it num_local_experts)
    _assert_logprobs_match_transformers(export, torch.load(out)["logprobs"])


@pytest.fixture(scope="module")
def moe_single(hf_qwen3_moe, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "single.pt"
    launch(1, "equivalence", "--out", str(out), "--hf", str(hf_qwen3_moe), "--optimizer", "sgd")
    return torch.load(out)


def test_moe_one_process_streamed_equals_sync(moe_single):
    assert _rel(_flat(moe_single["stream_grad"]), _flat(moe_single["sync_grad"])) <= MOE_GRAD_TOL


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_moe_layout_streamed_and_sync_equal_one_process(hf_qwen3_moe, tmp_path, moe_single, layout):
    """Expert parallelism (experts split over the TP ranks, which run the same trajectory), expert-tensor
    parallelism, PP, DP, and EP with DP (experts' gradients in DDP's expert-parallel buffers, reduced
    over the expert-data-parallel ranks), and expert grids spanning DP ranks (EP drawn from DP: the
    ranks of a grid form one data-parallel unit, running every trajectory in lockstep; measured
    6.8e-7 streamed at DP=2 x EP=2, 1.0e-6 at TP=2 x DP=2 with a 2 x 2 grid): the streamed and the
    batch gradients are one process's."""
    ranks, learner, expert_buffers = LAYOUTS[layout]
    out = tmp_path / "eq.pt"
    launch(ranks, "equivalence", "--out", str(out), "--hf", str(hf_qwen3_moe), "--optimizer", "sgd",
           "--learner", json.dumps(learner))
    run = torch.load(out)
    count, in_ledger = run["expert_buffers"]
    assert (count > 0) == expert_buffers and in_ledger  # the ledger streams into the expert buffers too
    assert torch.equal(_flat(run["before"]), _flat(moe_single["before"]))  # same import, every layout
    reference = _flat(moe_single["sync_grad"])
    assert _rel(_flat(run["stream_grad"]), reference) <= MOE_GRAD_TOL
    assert _rel(_flat(run["sync_grad"]), reference) <= MOE_GRAD_TOL
    assert _rel(_flat(run["stream"]), _flat(moe_single["sync"])) <= MOE_GRAD_TOL


REPLAY = {"moe": {"routing_replay": True}}


@pytest.fixture(scope="module")
def routing_record(hf_qwen3_moe, tmp_path_factory):
    out = tmp_path_factory.mktemp("replay") / "record.pt"
    launch(1, "routing_record", "--out", str(out), "--hf", str(hf_qwen3_moe), "--learner", json.dumps(REPLAY))
    return out


def test_replaying_the_learners_own_routing_changes_nothing_and_another_routing_does(routing_record):
    """Megatron's RouterReplay, fed the experts the learner's routers pick themselves, gives the same
    logprobs bit for bit (it gathers the router's scores at the given ids, which are the top-k values);
    fed a different valid choice for every token it gives other logprobs: the ids are what is used."""
    rec = torch.load(routing_record)
    for plain, own in zip(rec["plain"], rec["replay_own"], strict=True):
        assert torch.equal(plain, own)
    assert max((p - s).abs().max().item() for p, s in zip(rec["plain"], rec["replay_shifted"])) > 1e-2
    assert all(r.shape[1:] == (2, 2) and int(r.min()) >= 0 for r in rec["own"])  # [T-1, layers, top_k]


@pytest.fixture(scope="module")
def replay_single(hf_qwen3_moe, routing_record, tmp_path_factory):
    out = tmp_path_factory.mktemp("replay") / "single.pt"
    launch(1, "equivalence", "--out", str(out), "--hf", str(hf_qwen3_moe), "--optimizer", "sgd",
           "--routing", str(routing_record), "--learner", json.dumps(REPLAY))
    return torch.load(out)


def test_replayed_streamed_gradient_equals_the_batch_gradient(replay_single, routing_record):
    assert _rel(_flat(replay_single["stream_grad"]), _flat(replay_single["sync_grad"])) <= MOE_GRAD_TOL
    rec = torch.load(routing_record)
    for a, b in zip(replay_single["logp"], rec["replay_shifted"], strict=True):
        assert torch.equal(a, b)


def test_replay_under_tp2_pp2_ep2_equals_one_process(hf_qwen3_moe, tmp_path, replay_single, routing_record):
    """The replayed ids follow the layouts: under SP each TP rank replays its own slice of the sequence
    (rows s * b + j of its [s / TP, b] hidden states), under PP each stage its own layers (by Megatron's
    global layer number) -- the logprobs and both gradients are one process's, with the shifted routing
    every token takes (which no layout would pick by itself)."""
    out = tmp_path / "eq.pt"
    learner = _merge_json(REPLAY, {"parallel": {"tensor_parallel": 2, "pipeline_parallel": 2,
                                                "sequence_parallel": True, "expert_parallel": 2}})
    launch(4, "equivalence", "--out", str(out), "--hf", str(hf_qwen3_moe), "--optimizer", "sgd",
           "--routing", str(routing_record), "--learner", json.dumps(learner))
    run = torch.load(out)
    reference = _flat(replay_single["sync_grad"])
    assert _rel(_flat(run["stream_grad"]), reference) <= MOE_GRAD_TOL
    assert _rel(_flat(run["sync_grad"]), reference) <= MOE_GRAD_TOL
    for a, b in zip(run["logp"], replay_single["logp"], strict=True):
        assert torch.allclose(a, b, atol=LOGPROB_ATOL, rtol=0)


def _merge_json(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
        out[key] = _merge_json(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


ROUTER_LOSSES = {"moe": {"load_balancing_type": "seq_aux_loss", "aux_loss_coeff": 0.1, "z_loss_coeff": 1e-3}}
"""Megatron's per-sequence load-balancing loss and the router z-loss, both on (megathunder.learner.router_losses)."""


@pytest.fixture(scope="module")
def router_single(hf_qwen3_moe, tmp_path_factory):
    out = tmp_path_factory.mktemp("router") / "single.pt"
    launch(1, "equivalence", "--out", str(out), "--hf", str(hf_qwen3_moe), "--optimizer", "sgd", "--router-parts",
           "--learner", json.dumps(ROUTER_LOSSES))
    return torch.load(out)


def test_router_losses_streamed_equal_the_batch_gradient_and_each_term_counts(router_single, moe_single):
    """Streamed (one trajectory per backward, score-only passes without the router terms, the reward-free
    pass with them) == the batch gradient (packed micro-batches of rows of different lengths, so the pads
    are masked and each row is normalised by its own length), within the MoE bound; and the comparison
    can fail: the aux loss alone and the z-loss alone each move the gradient by far more than the bound."""
    reference = _flat(router_single["sync_grad"])
    assert _rel(_flat(router_single["stream_grad"]), reference) <= MOE_GRAD_TOL
    plain = _flat(moe_single["sync_grad"])  # the same batch without router losses
    aux_part = _flat(router_single["sync_grad_aux_only"]) - plain
    z_part = _flat(router_single["sync_grad_z_only"]) - plain
    assert aux_part.norm() / reference.norm() > 100 * MOE_GRAD_TOL
    assert z_part.norm() / reference.norm() > 100 * MOE_GRAD_TOL
    # the two terms add: the full gradient is the plain one plus each term's part
    assert _rel(plain + aux_part + z_part, reference) <= MOE_GRAD_TOL


@pytest.mark.parametrize("layout,ledger", [("ep2", {}), ("dp2", {"reward_free_terms": "at_finish"})])
def test_router_losses_under_layouts_equal_one_process(hf_qwen3_moe, tmp_path, router_single, layout, ledger):
    """TP=2 x EP=2 with SP: each TP rank routes its half of every sequence, the per-expert counts of a row
    are the all-reduced halves and each rank sums its own positions' scores; DP=2 with the reward-free
    terms at finish (a pass of their own, before the reward): both paths are one process's."""
    ranks, learner, _ = LAYOUTS[layout]
    out = tmp_path / "eq.pt"
    launch(ranks, "equivalence", "--out", str(out), "--hf", str(hf_qwen3_moe), "--optimizer", "sgd",
           "--learner", json.dumps(_merge_json(ROUTER_LOSSES, learner)), "--ledger", json.dumps(ledger))
    run = torch.load(out)
    reference = _flat(router_single["sync_grad"])
    assert _rel(_flat(run["stream_grad"]), reference) <= MOE_GRAD_TOL
    assert _rel(_flat(run["sync_grad"]), reference) <= MOE_GRAD_TOL


def test_moe_checkpoint_resume_is_bit_exact_at_tp2_ep2(hf_qwen3_moe, tmp_path):
    """A MoE learner's checkpoint (Megatron's sharded model and distributed-optimizer state, the experts in
    their expert-parallel shards and their Adam moments in the expert optimizer of the chained pair): a
    step after the reload is the uninterrupted run's step bit for bit (save after step 1 of 2, resume,
    step 2). Into one process (expert_parallel 1: a single optimizer, which megatron-core 0.16 cannot
    reshard the chained pair into) the load fails with a message naming the field, not Megatron's KeyError."""
    ckpt, saved, same, one = (tmp_path / name for name in ("ckpt", "saved.pt", "same.pt", "one.pt"))
    layout = json.dumps(EP2)
    launch(2, "checkpoint_save", "--out", str(saved), "--hf", str(hf_qwen3_moe), "--ckpt", str(ckpt), "--dist-opt",
           "--learner", layout)
    launch(2, "checkpoint_resume", "--out", str(same), "--hf", str(hf_qwen3_moe), "--ckpt", str(ckpt), "--dist-opt",
           "--learner", layout)
    reference, same = torch.load(saved), torch.load(same)
    assert any(".mlp.experts." in k for k in reference["after1"])
    assert same["num_steps"] == 1
    assert torch.equal(_flat(same["loaded"]), _flat(reference["after1"]))
    assert torch.equal(_flat(same["after2"]), _flat(reference["after2"]))  # resume is bit-exact
    assert not torch.equal(_flat(reference["after2"]), _flat(reference["after1"]))
    with pytest.raises(AssertionError, match="learner.parallel.expert_parallel > 1"):
        launch(1, "checkpoint_resume", "--out", str(one), "--hf", str(hf_qwen3_moe), "--ckpt", str(ckpt), "--dist-opt")
