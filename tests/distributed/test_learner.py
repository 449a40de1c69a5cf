"""The Megatron learner on CPU with gloo: TP=2, PP=2, DP=2 (and TP=2 x PP=2) against one process.

The weights come from one Hugging Face checkpoint, so every layout starts from the same
parameters. fp32 throughout; tolerances are relative (norm of the difference / norm).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import launch, make_hf_checkpoint

GRAD_TOL = 2e-6  # fp32: streamed vs sync and layout vs layout (observed ~2.5e-7)


def _flat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([d[k].reshape(-1).double() for k in sorted(d)])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _assert_logprobs_match_transformers(hf_dir, logprobs, temperature: float = 1.0) -> None:
    """The learner's logprobs of the worker's batch vs a transformers fp32 forward of hf_dir, at the
    sampling temperature (softmax(logits / T): what vLLM samples from and reports)."""
    import transformers

    from tests.distributed.learner_worker import make_batch

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float()
    batch, _, _ = make_batch(3, 64)
    for traj, logp in zip(batch, logprobs, strict=True):
        with torch.no_grad():
            logits = model(traj.tokens[None]).logits[0, :-1]
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, traj.tokens[1:, None])[:, 0]
        torch.testing.assert_close(logp, expected, rtol=0, atol=2e-6)


@pytest.fixture(scope="module")
def single(hf_qwen2, tmp_path_factory):
    out = tmp_path_factory.mktemp("eq") / "single.pt"
    launch(1, "equivalence", "--out", str(out), "--hf", str(hf_qwen2), "--optimizer", "sgd")
    return torch.load(out)


def test_single_process_streamed_equals_sync(single):
    assert _rel(_flat(single["stream_grad"]), _flat(single["sync_grad"])) <= GRAD_TOL
    step = _flat(single["stream"]) - _flat(single["before"])
    assert _rel(step, -_flat(single["stream_grad"])) <= 1e-6  # SGD, lr 1: the step is -grad


@pytest.mark.parametrize("layout", [("2", "1"), ("1", "2"), ("1", "1")], ids=["tp2", "pp2", "dp2"])
def test_layout_streamed_and_sync_equal_single_process(hf_qwen2, tmp_path, single, layout):
    tp, pp = layout
    out = tmp_path / "eq.pt"
    launch(2, "equivalence", "--out", str(out), "--hf", str(hf_qwen2), "--optimizer", "sgd",
           "--tp", tp, "--pp", pp)
    run = torch.load(out)
    assert torch.equal(_flat(run["before"]), _flat(single["before"]))
    reference = _flat(single["sync_grad"])
    assert _rel(_flat(run["stream_grad"]), reference) <= GRAD_TOL
    assert _rel(_flat(run["sync_grad"]), reference) <= GRAD_TOL
    assert _rel(_flat(run["stream"]), _flat(single["sync"])) <= GRAD_TOL


def test_distributed_optimizer_adam_step_matches_single_process(hf_qwen2, tmp_path, single):
    """DP=2 with Megatron's distributed optimizer (AdamW): parameters after one step."""
    outs = {}
    for nproc in (1, 2):
        outs[nproc] = tmp_path / f"adam{nproc}.pt"
        launch(nproc, "equivalence", "--out", str(outs[nproc]), "--hf", str(hf_qwen2),
               "--optimizer", "adam", "--lr", "1e-3", "--dist-opt")
    one, two = torch.load(outs[1]), torch.load(outs[2])
    if not torch.cuda.is_available():  # the learner's own optimizer took torch's fused CPU kernel
        assert one["fused_adam"] == two["fused_adam"] == [True], (one["fused_adam"], two["fused_adam"])
    grad = _flat(single["sync_grad"])
    significant = grad.abs() > 1e-4 * grad.abs().max()  # Adam's first step ~ lr * sign(g)
    reference = (_flat(one["sync"]) - _flat(one["before"]))[significant]
    for run in (one, two):
        for path in ("stream", "sync"):
            step = (_flat(run[path]) - _flat(run["before"]))[significant]
            assert _rel(step, reference) <= 1e-5, path


def test_tp2_pp2_hf_roundtrip_is_bit_exact_and_logprobs_match_transformers(hf_qwen2, tmp_path):
    """Each rank reads only its slices; each stage writes its own file (an HF sharded checkpoint)."""
    import json

    from megathunder.learner.safetensors_io import INDEX_NAME, load_dir

    export, out = tmp_path / "export", tmp_path / "rt.pt"
    launch(4, "hf_roundtrip", "--out", str(out), "--hf", str(hf_qwen2), "--export", str(export),
           "--tp", "2", "--pp", "2")
    original, exported = load_dir(hf_qwen2), load_dir(export)
    assert sorted(original) == sorted(exported)
    index = json.loads((export / INDEX_NAME).read_text())
    assert sorted(index["weight_map"]) == sorted(original)
    assert sorted(set(index["weight_map"].values())) == sorted(f.name for f in export.glob("*.safetensors"))
    assert all(torch.equal(original[k], exported[k]) for k in original)
    _assert_logprobs_match_transformers(export, torch.load(out)["logprobs"])


ROPE_SCALINGS = {  # short original lengths, so the scaling changes most frequencies of a 64-token test
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16},  # 128 / 16
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                              "attention_factor": 1.5},
}


@pytest.mark.parametrize("kind", sorted(ROPE_SCALINGS))
def test_rope_scaling_matches_transformers(tmp_path, kind):
    """RoPE scaling read from config.json and mapped to Megatron: the learner's logprobs (TP=2) are
    transformers' (which vLLM follows too); without the mapping they differ by ~1e-1 here."""
    hf_dir = make_hf_checkpoint(tmp_path / kind, "llama", tie=False, seed=2, rope_scaling=ROPE_SCALINGS[kind])
    out, export = tmp_path / "rt.pt", tmp_path / "export"
    launch(2, "hf_roundtrip", "--out", str(out), "--hf", str(hf_dir), "--export", str(export), "--tp", "2")
    _assert_logprobs_match_transformers(hf_dir, torch.load(out)["logprobs"])


def test_unsupported_rope_scaling_is_refused_by_name(tmp_path):
    from megathunder.config import ConfigError, PolicyModelConfig
    from megathunder.learner.model import policy_config_from_hf

    hf_dir = make_hf_checkpoint(tmp_path / "dyn", "llama", tie=False, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ConfigError, match="rope scaling 'dynamic'.*not supported"):
        policy_config_from_hf(hf_dir, PolicyModelConfig())


@pytest.mark.parametrize("family,tie", [("qwen3", True), ("llama", False)])
def test_other_families_import_and_match_transformers(tmp_path, family, tie):
    hf_dir = make_hf_checkpoint(tmp_path / family, family, tie=tie, seed=1)
    out, export = tmp_path / "rt.pt", tmp_path / "export"
    launch(2, "hf_roundtrip", "--out", str(out), "--hf", str(hf_dir), "--export", str(export), "--tp", "2",
           "--temperature", "0.7")
    _assert_logprobs_match_transformers(hf_dir, torch.load(out)["logprobs"], temperature=0.7)


def test_a_checkpoint_before_the_first_optimizer_step_writes_nothing(hf_qwen2, tmp_path):
    """Ctrl-C / SIGUSR1 before the first step: Megatron's distributed optimizer has no state to save
    (its ``state_dict`` asserts a step); the save is skipped, nothing half-written stays behind, and
    the first step's checkpoint is then written as usual (learner_worker.checkpoint_before_step)."""
    launch(1, "checkpoint_before_step", "--out", str(tmp_path / "unused"), "--hf", str(hf_qwen2),
           "--ckpt", str(tmp_path / "ckpt"), "--dist-opt")


@pytest.mark.parametrize("dist_opt", [[], ["--dist-opt"], ["--ckpt-optimizer", "sgd"]],
                         ids=["plain_optimizer", "distributed_optimizer", "sgd_with_momentum"])
def test_checkpoint_resume_is_exact_and_reshards_tp1_to_tp2(hf_qwen2, tmp_path, dist_opt):
    ckpt, saved = tmp_path / "ckpt", tmp_path / "saved.pt"
    launch(1, "checkpoint_save", "--out", str(saved), "--hf", str(hf_qwen2), "--ckpt", str(ckpt), *dist_opt)
    reference = torch.load(saved)
    same, tp2 = tmp_path / "same.pt", tmp_path / "tp2.pt"
    launch(1, "checkpoint_resume", "--out", str(same), "--hf", str(hf_qwen2), "--ckpt", str(ckpt), *dist_opt)
    launch(2, "checkpoint_resume", "--out", str(tp2), "--hf", str(hf_qwen2), "--ckpt", str(ckpt), "--tp", "2",
           *dist_opt)
    same, tp2 = torch.load(same), torch.load(tp2)
    assert same["num_steps"] == tp2["num_steps"] == 1
    assert torch.equal(_flat(same["loaded"]), _flat(reference["after1"]))
    assert torch.equal(_flat(same["after2"]), _flat(reference["after2"]))  # resume is bit-exact
    assert torch.equal(_flat(tp2["loaded"]), _flat(reference["after1"]))  # TP=1 -> TP=2 load
    step = _flat(reference["after2"]) - _flat(reference["after1"])
    assert _rel(_flat(tp2["after2"]) - _flat(reference["after1"]), step) <= 1e-4


def test_tp2_with_kl_entropy_and_dapo_matches_single_process(hf_qwen2, tmp_path):
    """Vocab-parallel entropy and the frozen reference model under TP=2 (k1's gradient is nonzero
    even where policy == reference). Caught a real bug: a reduced log-partition used inside a
    rank-local sum dropped the other rank's terms from the entropy gradient (1e-3 off)."""
    objective = ('{"kl_coef": 0.1, "kl_estimator": "k1", "entropy_coef": 0.01, "advantage": "rloo",'
                 ' "loss_agg": "seq_mean_token_mean", "dapo_dynamic_sampling": true}')
    runs = {}
    for tp in (1, 2):
        runs[tp] = tmp_path / f"tp{tp}.pt"
        launch(tp, "equivalence", "--out", str(runs[tp]), "--hf", str(hf_qwen2), "--optimizer", "sgd",
               "--tp", str(tp), "--objective", objective)
    one, two = torch.load(runs[1]), torch.load(runs[2])
    reference = _flat(one["sync_grad"])
    assert _rel(_flat(one["stream_grad"]), reference) <= GRAD_TOL
    assert _rel(_flat(two["stream_grad"]), reference) <= GRAD_TOL
    assert _rel(_flat(two["sync_grad"]), reference) <= GRAD_TOL


def test_checkpoint_resume_with_dp2_and_the_distributed_optimizer_is_exact(hf_qwen2, tmp_path):
    """A fresh process's DistributedOptimizer has no per-parameter state to load into (Megatron
    asserts on it without apex/TE): the requeued multi-rank trainer hit this on resume."""
    ckpt, saved, resumed = tmp_path / "ckpt", tmp_path / "saved.pt", tmp_path / "resumed.pt"
    launch(2, "checkpoint_save", "--out", str(saved), "--hf", str(hf_qwen2), "--ckpt", str(ckpt), "--dist-opt")
    launch(2, "checkpoint_resume", "--out", str(resumed), "--hf", str(hf_qwen2), "--ckpt", str(ckpt), "--dist-opt")
    reference, resumed = torch.load(saved), torch.load(resumed)
    assert resumed["num_steps"] == 1
    assert torch.equal(_flat(resumed["loaded"]), _flat(reference["after1"]))
    assert torch.equal(_flat(resumed["after2"]), _flat(reference["after2"]))


# Long trajectories: sequence parallelism, activation recompute and the core attention are memory
# options, not different functions. Each gives the gradient of the same loss: SP moves the same sums
# between ranks (reduce-scatter + all-gather instead of all-reduce), recompute runs the same forward
# twice, the default SDPA attention is an online softmax of the scores the local spec's unfused one
# stores whole; every trajectory under SP is padded at its end (causal: no real position sees the
# pads). So each equals one process with the defaults up to fp32 reassociation, the same bound as
# layouts (GRAD_TOL).
MEMORY_OPTIONS = {
    "sp": (2, {"parallel": {"sequence_parallel": True}}),
    "recompute_selective": (2, {"activations": {"recompute": "selective"}}),
    "recompute_full_uniform": (2, {"activations": {"recompute": "full", "recompute_method": "uniform",
                                                   "recompute_num_layers": 1}}),
    "recompute_full_block_sp": (2, {"parallel": {"sequence_parallel": True},
                                    "activations": {"recompute": "full", "recompute_method": "block",
                                                    "recompute_num_layers": 1}}),
    "unfused": (2, {"precision": {"core_attention": "megatron"}}),
    "unfused_selective": (1, {"precision": {"core_attention": "megatron"}, "activations": {"recompute": "selective"}}),
    "sdpa_sp_selective_mlp": (2, {"parallel": {"sequence_parallel": True}, "precision": {"core_attention": "sdpa"},
                                  "activations": {"recompute": "selective",
                                                  "recompute_modules": ["core_attn", "mlp"]}}),
}


@pytest.mark.parametrize("option", sorted(MEMORY_OPTIONS))
def test_memory_options_give_the_gradient_of_one_process_without_them(hf_qwen2, tmp_path, single, option):
    tp, learner = MEMORY_OPTIONS[option]
    import json

    out = tmp_path / "opt.pt"
    launch(tp, "equivalence", "--out", str(out), "--hf", str(hf_qwen2), "--optimizer", "sgd", "--tp", str(tp),
           "--learner", json.dumps(learner))
    run = torch.load(out)
    reference = _flat(single["sync_grad"])
    assert _rel(_flat(run["stream_grad"]), reference) <= GRAD_TOL
    assert _rel(_flat(run["sync_grad"]), reference) <= GRAD_TOL


@pytest.mark.parametrize("ledger", [{"slot_placement": "host"}, {"slot_placement": "host", "slot_dtype": "bfloat16"}],
                         ids=["host", "host_bf16"])
def test_host_placed_slots_give_the_update_of_device_slots_on_megatron(hf_qwen2, tmp_path, single, ledger):
    """On Megatron's gradient buffers, one process: host slots equal device slots bitwise (a CPU
    learner: one memory, the same kernels); bf16 host slots equal bf16 device slots bitwise."""
    import json

    runs = {}
    for placement in ("device", "host"):
        runs[placement] = tmp_path / f"{placement}.pt"
        launch(1, "equivalence", "--out", str(runs[placement]), "--hf", str(hf_qwen2), "--optimizer", "sgd",
               "--ledger", json.dumps({**ledger, "slot_placement": placement}))
    device, host = torch.load(runs["device"]), torch.load(runs["host"])
    assert torch.equal(_flat(host["stream_grad"]), _flat(device["stream_grad"]))
    assert torch.equal(_flat(host["stream"]), _flat(device["stream"]))
    if "slot_dtype" not in ledger:
        assert torch.equal(_flat(host["stream_grad"]), _flat(single["stream_grad"]))


HOST_LAYOUTS = {"dp2": (2, "1", "1"), "tp2_pp2": (4, "2", "2"), "tp2_pp2_dp2": (8, "2", "2")}  # (processes, --tp, --pp)


@pytest.mark.parametrize("layout", [k if k == "dp2" else pytest.param(k, marks=pytest.mark.slow) for k in HOST_LAYOUTS])
def test_threaded_host_slots_give_the_sync_gradient_on_megatron(hf_qwen2, tmp_path, single, layout):
    """Host slots added on 3 threads in chunks, S and R from one staged copy, with pending
    gradients folded host-side, on Megatron's sharded gradient buffers: the batch-synchronous
    gradient up to fp32 reassociation (GRAD_TOL), as device slots."""
    import json

    procs, tp, pp = HOST_LAYOUTS[layout]
    out = tmp_path / "host.pt"
    launch(procs, "equivalence", "--out", str(out), "--hf", str(hf_qwen2), "--optimizer", "sgd", "--tp", tp, "--pp", pp,
           "--ledger", json.dumps({"slot_placement": "host", "host_threads": 3, "max_pending": 2}))
    run = torch.load(out)
    assert _rel(_flat(run["stream_grad"]), _flat(single["sync_grad"])) <= GRAD_TOL
    assert _rel(_flat(run["stream"]), _flat(single["sync"])) <= GRAD_TOL


# TP=2: the ledger's pending path is the DP=2 case's, on TP-sharded buffers (which the other TP tests cover)
@pytest.mark.parametrize("layout", [pytest.param(("2", "1"), marks=pytest.mark.slow), ("1", "1")], ids=["tp2", "dp2"])
def test_pending_gradients_give_the_sync_gradient_on_megatron(hf_qwen2, tmp_path, single, layout):
    """``ledger.max_pending`` unbounded on Megatron's buffers: every trajectory's h_i is computed at
    finish into a pending buffer and folded at its reward; the streamed gradient is the
    batch-synchronous one up to fp32 reassociation (GRAD_TOL), as without pending buffers."""
    import json

    tp, pp = layout
    out = tmp_path / "pending.pt"
    launch(2, "equivalence", "--out", str(out), "--hf", str(hf_qwen2), "--optimizer", "sgd", "--tp", tp, "--pp", pp,
           "--ledger", json.dumps({"max_pending": None}))
    run = torch.load(out)
    assert run["pending_backward"] > 0 and run["peak_pending"] > 0  # rank 0's ledger used them
    reference = _flat(single["sync_grad"])
    assert _rel(_flat(run["stream_grad"]), reference) <= GRAD_TOL
    assert _rel(_flat(run["stream"]), _flat(single["sync"])) <= GRAD_TOL


def test_zero_advantages_run_no_pass_and_change_no_bit_on_megatron(hf_qwen2, tmp_path, single):
    """The batch-synchronous gradient skips trajectories whose advantage is 0 (a group whose binary
    rewards are all equal; ``objective.skip_zero_advantage``, on by default): the gradient with them
    run, up to fp32 reassociation (the packed micro-batches hold other trajectories), in fewer
    passes; the streamed gradient the same too."""
    import json

    from megathunder.trajectory import batch_plan
    from tests.distributed.learner_worker import make_batch

    batch, rewards, _ = make_batch(0, 64)
    zero = sum(len(m) for _, m in batch_plan(batch) if len({rewards[i] for i in m}) == 1)
    assert zero > 0  # the worker's batch has a uniform group
    out = tmp_path / "noskip.pt"
    launch(1, "equivalence", "--out", str(out), "--hf", str(hf_qwen2), "--optimizer", "sgd",
           "--objective", json.dumps({"skip_zero_advantage": False}))
    run = torch.load(out)
    assert _rel(_flat(run["sync_grad"]), _flat(single["sync_grad"])) <= GRAD_TOL
    assert run["sync_passes"] == len(batch) and single["sync_passes"] == len(batch) - zero
    assert _rel(_flat(run["stream_grad"]), _flat(single["stream_grad"])) <= GRAD_TOL


TURN_LAYOUTS = {  # name: (processes, --tp, strategy, objective)
    "single_kv_adjoint": (1, "1", "kv_adjoint", {}),
    "single_recompute_tis": (1, "1", "recompute", {"tis": "token"}),
    "dp2_kv_adjoint": (2, "1", "kv_adjoint", {}),
    "tp2_forward_early_tis": (2, "2", "forward_early", {"tis": "token"}),
}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k.startswith("tp2") else k
                                    for k in TURN_LAYOUTS])
def test_per_turn_score_gradients_give_the_sync_gradient_on_megatron(hf_qwen2, tmp_path, single, layout):
    """``ledger.per_turn_scores`` on Megatron (``GRPOBatch`` with turn events, segment forwards on
    past K/V, DP owners claimed at first turns): every trajectory's h_i accumulates turn by turn in
    a pending buffer; the streamed gradient is the batch-synchronous one up to fp32 reassociation
    (GRAD_TOL), as the fp64 unit tests show exactly (tests/unit/test_score_turns.py)."""
    import json

    procs, tp, strategy, objective = TURN_LAYOUTS[layout]
    out = tmp_path / "turns.pt"
    launch(procs, "equivalence", "--out", str(out), "--hf", str(hf_qwen2), "--optimizer", "sgd", "--tp", tp,
           "--learner", json.dumps({"precision": {"core_attention": "past_kv"}}), "--ledger-turns",
           "--objective", json.dumps(objective),
           "--ledger", json.dumps({"max_pending": None, "per_turn_scores": strategy}))
    run = torch.load(out)
    assert run["turn_scores"] > 0  # rank 0's ledger took h_i turn by turn
    assert _rel(_flat(run["stream_grad"]), _flat(run["sync_grad"])) <= GRAD_TOL
    assert _rel(_flat(run["stream"]), _flat(run["sync"])) <= GRAD_TOL
    if not objective:  # and the one-process reference of the default objective
        assert _rel(_flat(run["stream_grad"]), _flat(single["sync_grad"])) <= GRAD_TOL


PPO_TOL = 1e-5
"""fp32, 4 SGD steps: each step's gradient agrees with transformers' to ~3e-7 (GRAD_TOL bounds one
step at 2e-6); the parameter change sums four of them plus their propagation through the loss
curvature. Observed 3.4e-7 (1 process) to 6.9e-7 (TP=2); the bound is GRAD_TOL x 4 steps rounded up.
It holds only while no ratio lies within fp32 noise of a clip boundary: checked (> 1e-4) below."""


@pytest.mark.parametrize("tp", ["1", "2"], ids=["dp2", "tp2"])
def test_ppo_epochs_and_minibatches_match_the_published_loop(hf_qwen2, tmp_path, tp):
    """2 epochs x 2 mini-batches with PPO-clip and dual clip on the Megatron learner, 2 ranks as DP=2
    or TP=2 (the sync path:
    ``GRPOBatch`` at close, then ``step``) vs the textbook loop of ``tests/unit/test_ppo.py`` on the
    same weights in transformers, SGD: the parameter changes agree, with clipping active."""
    import json

    import transformers

    from tests.distributed.learner_worker import make_batch
    from tests.unit.test_ppo import _published_ppo

    lr, eps_low, eps_high, clip_c = 3.0, 0.05, 0.08, 1.5
    objective = {"num_ppo_epochs": 2, "num_minibatches_per_batch": 2, "clip_eps_low": eps_low,
                 "clip_eps_high": eps_high, "clip_ratio_c": clip_c}
    out = tmp_path / "ppo.pt"
    launch(2, "ppo", "--out", str(out), "--hf", str(hf_qwen2), "--lr", str(lr), "--tp", tp,
           "--objective", json.dumps(objective))
    run = torch.load(out)
    assert run["num_steps"] == 1  # one batch: the schedule and the step count advance once

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_qwen2).float()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, tokens):
            return self.model(tokens).logits

    batch, rewards, _ = make_batch(0, model.config.vocab_size)
    stats = _published_ppo(Logits(), batch, rewards, epochs=2, num_mb=2, eps_low=eps_low, eps_high=eps_high,
                           clip_c=clip_c, old_from_rollout=False, lr=lr)
    assert max(s[0] for s in stats) > 0.5 and max(s[1] for s in stats) > 0, stats  # clip and dual clip act
    assert min(s[2] for s in stats) > 1e-4, stats
    expected = model.state_dict()
    names = sorted(run["before"])
    ours = torch.cat([(run["after"][k] - run["before"][k]).reshape(-1).double() for k in names])
    theirs = torch.cat([(expected[k].double() - run["before"][k].double()).reshape(-1) for k in names])
    assert _rel(ours, theirs) <= PPO_TOL


# Packing (``learner.pack_tokens``): several trajectories per micro-batch, one [rows, T_max] forward,
# right-padded; the micro-batch's loss is the sum of its trajectories' losses. Rows never interact
# (attention is per row and causal, norms and matmuls per position) and the pads' targets are cut
# before the loss, so the packed gradient is the unpacked one up to fp32 reassociation: the weight
# gradients' GEMMs sum a micro-batch's tokens in one call instead of one trajectory's at a time, the
# same kind of reordering GRAD_TOL bounds between layouts (observed 1.1e-7 to 1.5e-7 on the four
# layouts). Logprobs are per-row forward values (no sum over trajectories): a few ulp of fp32 apart.
# The packed run also computes the output layer only at the loss's targets
# (``learner.loss_logits_only``; under SP through its own all-gather / reduce-scatter pair), the
# unpacked one at every position: the head's rows are the same hidden states, its weight gradient
# the same products summed over fewer (zero) rows, so the same tolerance holds.
LOGP_TOL = 4e-6  # 4 ulp of fp32 at |logp| < 8 (vocabulary 64: logp ~ -4); observed 4.8e-7 (1 ulp)
PACK_OBJECTIVE = ('{"kl_coef": 0.1, "entropy_coef": 0.01, "advantage": "rloo", "loss_agg": "seq_mean_token_mean"}')


@pytest.mark.parametrize("layout", [(1, "1", "1", {}), (2, "2", "1", {"parallel": {"sequence_parallel": True}}),
                                    (2, "1", "2", {}), (2, "1", "1", {})], ids=["single", "tp2_sp", "pp2", "dp2"])
def test_packed_micro_batches_give_the_unpacked_gradient(hf_qwen2, tmp_path, layout):
    """The sync gradient (``grpo_gradient``), the summed backward (``backward_sum``) and token logprobs
    (the reference model's included), packed with logits at the loss's targets only -- and with each
    group's shared prompt forwarded once (``learner.share_prefixes``) -- vs one trajectory per
    micro-batch with logits everywhere, on every layout."""
    import json

    nproc, tp, pp, learner = layout
    out = tmp_path / "pack.pt"
    launch(nproc, "packing", "--out", str(out), "--hf", str(hf_qwen2), "--tp", tp, "--pp", pp,
           "--objective", PACK_OBJECTIVE, "--learner", json.dumps(learner), "--pack", "64")
    run = torch.load(out)
    assert max(len(g) for g in run["groups"]) >= 2 and len(run["groups"]) >= 2  # it packed (rank 0's share)
    assert run["supported"] and max(len(r) for r in run["shared_rows"]) >= 2  # and shared prompts
    for path in ("sync_grad", "sum_grad"):
        assert _rel(_flat(run[f"packed_{path}"]), _flat(run[f"unpacked_{path}"])) <= GRAD_TOL, path
        assert _rel(_flat(run[f"shared_{path}"]), _flat(run[f"unpacked_{path}"])) <= GRAD_TOL, path
    for key in ("logp", "ref"):
        for packed, shared, unpacked in zip(run[f"packed_{key}"], run[f"shared_{key}"], run[f"unpacked_{key}"],
                                            strict=True):
            torch.testing.assert_close(packed, unpacked, rtol=0, atol=LOGP_TOL)
            torch.testing.assert_close(shared, unpacked, rtol=0, atol=LOGP_TOL)


@pytest.mark.parametrize("layout", [(1, "1"), (2, "2")], ids=["single", "pp2"])
def test_own_gradients_in_one_call_are_bitwise_one_call_each(hf_qwen2, tmp_path, layout):
    """``backward_each`` (the ledger's packed slot and pending passes): every trajectory's own
    gradients from one schedule call -- pipelined under PP -- are bit for bit what one call per
    trajectory and pass leaves in the buffers, on every stage, handed back in order."""
    nproc, pp = layout
    out = tmp_path / "each.pt"
    launch(nproc, "each", "--out", str(out), "--hf", str(hf_qwen2), "--pp", pp,
           "--objective", '{"kl_coef": 0.1, "entropy_coef": 0.01}')
    for stage in range(int(pp)):
        run = torch.load(f"{out}.stage{stage}")
        n = len(run["alone"])
        assert n >= 2 and run["calls"] == [2 * n]  # one schedule call for every trajectory's two passes
        assert run["order"] == [(k, j) for k in range(n) for j in range(2)]
        pairs = [(a, b) for alone, together in zip(run["alone"], run["together"], strict=True)
                 for a, b in zip(alone, together, strict=True)]
        assert all(torch.equal(a, b) for a, b in pairs)
        assert sum(bool(a.abs().sum() > 0) for a, _ in pairs) >= n  # not zeros alike (an empty trajectory's are)
