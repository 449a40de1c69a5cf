"""``megathunder plan``: parameter and optimizer accounting against Megatron's own formula, the
shipped 128-GPU configs on 80 GB H100s, and layouts refused naming the part that does not divide
or fit. (Activations: ``tests/distributed/test_memory_plan_activations.py``; the whole per-rank
prediction against measured peaks: ``megathunder bench memory``, BENCHMARKS.md.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megathunder.config import PolicyModelConfig, load_config
from megathunder.plan import plan_cmd
from megathunder.plan.memory_plan import GiB, Machine, ModelShape, pinned, plan, read_model_config, stage_params
from megathunder.streaming.buffers import slots_within_budget

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "tests" / "fixtures" / "models"
H100 = Machine(gpu_memory_gb=80.0, ranks_per_node=8, host_memory_gb=2048.0, world=96)


def qwen(size: str) -> str:
    return str(MODELS / f"Qwen2.5-{size}-Instruct")


def shape_of(size: str) -> ModelShape:
    return ModelShape.of(read_model_config(qwen(size), PolicyModelConfig(), "learner.model.hf_checkpoint"))


def megatron_weight_and_optimizer(h, F, L, a, g, d, V, untied, tp, pp, dp, dist_opt) -> tuple[float, float]:
    """Megatron-LM's ``compute_weight_and_optimizer_memory`` (megatron/training/theoretical_memory_usage.py,
    dense, SwiGLU, RMSNorm, no MTP): (parameters of the most loaded shard, its bytes)."""
    self_attn = 2 * h * h * ((1 + g / a) * (d * a / h))
    layer = 2 * h * (F * 3 / 2 + 1) + self_attn
    embedding = h * V
    block = layer * L + h  # + final layernorm
    shard = (block / pp + embedding) / tp
    if untied and pp == 1:
        shard += embedding / tp
    per_param = 18 if not dist_opt else 6 + 12 / dp
    return shard, shard * per_param


@pytest.mark.parametrize("layout", [(1, 1, 1, False), (8, 2, 6, True), (4, 1, 24, True), (2, 4, 1, False)])
def test_parameters_and_optimizer_bytes_match_megatrons_accounting(layout):
    """Llama-family Qwen2.5-32B shapes (no q/k/v bias, which Megatron's formula leaves out): the
    most loaded shard's parameters, and weights + gradients + Adam bytes (18 B/param, or 6 + 12/DP
    with the distributed optimizer), agree with Megatron's formula up to its one approximation:
    it divides the RMSNorm weights by TP and the final norm by PP, where the model replicates
    them on every TP rank and keeps the final norm on the last stage (which we count)."""
    tp, pp, dp, dist_opt = layout
    m = read_model_config(qwen("32B"), PolicyModelConfig(), "x").model_copy(update={"family": "llama"})
    shape = ModelShape.of(m)
    ours = max(sum(stage_params(shape, tp, pp, s)) for s in range(pp))
    theirs, theirs_bytes = megatron_weight_and_optimizer(m.hidden_size, m.ffn_hidden_size, m.num_layers,
                                                        m.num_attention_heads, m.num_query_groups, 128,
                                                        m.vocab_size, True, tp, pp, dp, dist_opt)
    h = m.hidden_size
    replicated = m.num_layers // pp * 2 * h * (1 - 1 / tp) + h - h / (pp * tp)
    assert ours - theirs == pytest.approx(replicated, abs=1e-6)
    cfg = load_config(None, ["learner.precision.params_dtype=bfloat16", "schedule.mode=sync",
                             f"learner.parallel.tensor_parallel={tp}", f"learner.parallel.pipeline_parallel={pp}",
                             f"learner.optimizer.use_distributed_optimizer={str(dist_opt).lower()}",
                             "learner.model.hf_checkpoint=" + qwen("32B")])
    result = plan(cfg, shape, Machine(gpu_memory_gb=None, world=tp * pp * dp))
    lines = {line.part: line.device for line in result.lines}
    per_param = theirs_bytes / theirs  # Megatron's bytes per parameter: 18, or 6 + 12 / DP
    stage = sum(stage_params(shape, tp, pp, result.stage))
    assert (lines["weights"] + lines["gradients"] + lines["optimizer"]) / stage == pytest.approx(per_param, rel=1e-12)


def test_published_parameter_counts():
    counts = {size: shape_of(size).num_params for size in ("7B", "32B", "72B")}
    assert round(counts["7B"] / 1e9, 2) == 7.62 and round(counts["32B"] / 1e9, 1) == 32.8
    assert round(counts["72B"] / 1e9, 1) == 72.7


def test_shipped_grpo_config_fits_an_80_gb_h100_with_qwen2_5_32b():
    cfg = load_config(REPO / "launch/slurm/grpo_128gpu.yaml", ["learner.model.hf_checkpoint=" + qwen("32B")])
    result = plan_cmd.run_plan(cfg, H100)
    assert result.feasible, result.problems
    assert result.layout["dp"] == 6 and result.device_total <= 80 * GiB
    # K from the slot budget: 64 GiB of host memory for fp32 S and R of 2.05B parameters per rank
    buffer = sum(stage_params(shape_of("32B"), 8, 2, 1)) * 4
    assert result.ledger_slots == slots_within_budget(None, 64.0, buffer, 2) == 4
    assert result.node_host_total <= 2048 * GiB
    # the same layout with the old settings (K = 4 fp32 slots on the device, no SP / recompute at 4k tokens)
    old = load_config(REPO / "launch/slurm/grpo_128gpu.yaml",
                      ["learner.model.hf_checkpoint=" + qwen("32B"), "ledger.max_group_slots=4",
                       "ledger.slot_placement=device", "ledger.slot_budget_gb=null", "agent.max_total_tokens=4096",
                       "learner.parallel.sequence_parallel=false", "learner.activations.recompute=none"])
    refused = plan_cmd.run_plan(old, H100)
    assert not refused.feasible and "ledger slots" in refused.problems[0]


def test_every_stage_sender_holds_a_bucket_and_its_largest_gathered_parameter():
    """The streamed push (``megathunder.learner.push``): stage s's (TP 0, DP 0) rank holds two buckets
    (one packed, one on the wire) and one parameter gathered over TP in the engine's dtype -- the embedding on stage 0, the output
    layer on the last (Qwen2.5-32B, untied: 152064 x 5120 x 2 B = 1.45 GiB on each of its 2 stages)
    -- plus, with sparse patches, its shards as last pushed."""
    shape = shape_of("32B")
    overrides = ["learner.model.hf_checkpoint=" + qwen("32B")]
    for sparse in (0.0, 0.05):
        cfg = load_config(REPO / "launch/slurm/grpo_128gpu.yaml",
                          [*overrides, f"rollout.engine.weight_transfer.sparse_threshold={sparse}"])
        result = plan(cfg, shape, H100)
        (line,) = [line for line in result.lines if line.part == "weight push"]
        expected = 2 * cfg.rollout.engine.weight_transfer.bucket_mb * 2**20 + shape.vocab * shape.hidden * 2
        if sparse:
            expected += sum(stage_params(shape, 8, 2, result.stage)) * 2
        assert line.device == expected and not line.rank0_only


def test_shipped_opd_config_fits_with_the_student_at_tp4():
    cfg = load_config(REPO / "launch/slurm/opd_128gpu.yaml",
                      ["learner.model.hf_checkpoint=" + qwen("7B"), "objective.teacher.hf_checkpoint=" + qwen("32B")])
    result = plan_cmd.run_plan(cfg, H100)
    assert result.feasible, result.problems
    assert result.layout["tp"] == 4 and result.layout["dp"] == 24
    parts = {line.part for line in result.lines}
    assert {"teacher", "teacher K/V", "OPD state"} <= parts


def test_qwen2_5_7b_at_tp8_is_refused_naming_the_heads():
    cfg = load_config(REPO / "launch/slurm/opd_128gpu.yaml",
                      ["learner.model.hf_checkpoint=" + qwen("7B"), "objective.teacher.hf_checkpoint=" + qwen("32B"),
                       "learner.parallel.tensor_parallel=8"])
    result = plan_cmd.run_plan(cfg, H100)
    assert result.problems == ["learner.parallel.tensor_parallel: 8 does not divide "
                               "learner.model.num_attention_heads=28"]


@pytest.mark.parametrize("overrides,size,world,expected", [
    (["learner.parallel.tensor_parallel=16"], "72B", 96, "does not divide learner.model.num_query_groups=8"),
    (["learner.parallel.pipeline_parallel=3"], "7B", 96, "pipeline_parallel: 3 does not divide learner.model.num_layers=28"),
    (["learner.parallel.tensor_parallel=8", "learner.parallel.pipeline_parallel=2"], "32B", 100,
     "world size 100 is not a multiple"),
])
def test_layouts_that_do_not_divide_are_refused_naming_the_field(overrides, size, world, expected):
    cfg = load_config(None, ["learner.model.hf_checkpoint=" + qwen(size), *overrides])
    result = plan_cmd.run_plan(cfg, Machine(world=world))
    assert not result.feasible and expected in result.problems[0], result.problems


def test_a_teacher_the_layout_cannot_shard_is_named():
    cfg = load_config(REPO / "launch/slurm/opd_128gpu.yaml",
                      ["learner.model.hf_checkpoint=" + qwen("32B"), "objective.teacher.hf_checkpoint=" + qwen("7B"),
                       "learner.parallel.tensor_parallel=8"])
    result = plan_cmd.run_plan(cfg, H100)
    assert result.problems == ["learner.parallel.tensor_parallel: 8 does not divide "
                               "objective.teacher.num_attention_heads=28"]


def test_memory_options_lower_the_activation_line():
    base = ["learner.model.hf_checkpoint=" + qwen("32B"), "learner.parallel.tensor_parallel=8",
            "agent.max_total_tokens=32768", "learner.precision.params_dtype=bfloat16", "schedule.mode=sync"]
    acts = {}
    for name, extra in {"none": ["learner.precision.core_attention=megatron"], "auto": [],
                        "sdpa": ["learner.precision.core_attention=sdpa"],
                        "sp_selective": ["learner.precision.core_attention=sdpa", "learner.parallel.sequence_parallel=true",
                                         "learner.activations.recompute=selective"],
                        "sp_full": ["learner.precision.core_attention=sdpa", "learner.parallel.sequence_parallel=true",
                                    "learner.activations.recompute=full"]}.items():
        result = plan_cmd.run_plan(load_config(None, base + extra), Machine(gpu_memory_gb=80.0, world=8))
        acts[name] = next(line.device for line in result.lines if line.part == "activations")
    # the unfused local attention keeps 5 heads x 32k^2 x 2 bytes per layer: ~10 GiB per layer
    assert acts["none"] > 600 * GiB
    assert acts["sdpa"] < acts["none"] / 4
    assert acts["auto"] == acts["sdpa"]  # auto is the fused attention on the local spec
    assert acts["sp_full"] < acts["sp_selective"] < acts["sdpa"]


def test_plan_command_prints_a_table_and_a_json_last_line(capsys):
    status = plan_cmd.main([str(REPO / "launch/slurm/grpo_128gpu.yaml"), "learner.model.hf_checkpoint=" + qwen("32B"),
                            "--world", "96", "--host-memory-gb", "2048"])
    out = capsys.readouterr().out.strip().splitlines()
    assert status == 0
    assert out[0].startswith("layout: world 96 = tp 8 x pp 2 x cp 1 x dp 6 (sequence parallel)")
    result = json.loads(out[-1])["plan"]
    assert result["feasible"] and result["device_bytes"] <= 80 * GiB and result["ledger_slots"] == 4
    assert set(result["links"]) >= {"tp_per_trajectory", "pp_per_trajectory", "dp_reduce_per_step",
                                    "weight_push_per_step"}
    status = plan_cmd.main([str(REPO / "launch/slurm/opd_128gpu.yaml"), "learner.model.hf_checkpoint=" + qwen("7B"),
                            "objective.teacher.hf_checkpoint=" + qwen("32B"), "learner.parallel.tensor_parallel=8",
                            "--world", "96"])
    captured = capsys.readouterr()
    assert status == 1
    assert "INFEASIBLE: learner.parallel.tensor_parallel: 8 does not divide learner.model.num_attention_heads=28" \
        in captured.err
    assert plan_cmd.main([str(REPO / "launch/slurm/grpo_128gpu.yaml"), "--world", "96"]) == 2  # no config.json
    assert "learner.model.hf_checkpoint: no config.json at /models/Qwen2.5-32B-Instruct" in capsys.readouterr().err


def test_cpu_plan_of_the_quickstart_counts_every_rank_in_the_node():
    cfg = load_config(REPO / "configs/quickstart.yaml")
    result = plan_cmd.run_plan(cfg, Machine(gpu_memory_gb=None, ranks_per_node=8, host_memory_gb=24.0, world=2))
    assert result.feasible
    ranks = next(line for line in result.node_host if line.part.endswith("ranks"))
    assert ranks.part == "2 ranks" and ranks.host >= 2 * result.device_total


def test_packing_counts_the_rows_of_one_micro_batch():
    """``learner.pack_tokens``: a micro-batch holds up to pack_tokens // s trajectories of the longest
    length s, and never more than a schedule call's: the activation line grows by that many rows."""
    base = ["learner.model.hf_checkpoint=" + qwen("7B"), "agent.max_total_tokens=512", "agent.max_new_tokens_per_turn=256", "schedule.mode=sync",
            "batch.num_prompts_per_batch=2", "batch.samples_per_prompt=2"]  # 4 trajectories on the rank
    acts = {}
    for pack in (0, 512, 1024, 4096):
        result = plan_cmd.run_plan(load_config(None, [*base, f"learner.pack_tokens={pack}"]),
                                   Machine(gpu_memory_gb=80.0, world=1))
        acts[pack] = next(line.device for line in result.lines if line.part == "activations")
    assert acts[0] == acts[512]  # one row of 512 tokens either way
    assert acts[1024] == pytest.approx(2 * acts[0])
    assert acts[4096] == pytest.approx(4 * acts[0])  # 8 rows would fit; the call has 4 trajectories


MOE = str(MODELS / "Qwen3-30B-A3B")


def test_qwen3_30b_a3b_counts_experts_per_rank_and_per_push():
    """The published Qwen3-30B-A3B shape (48 layers, 128 experts of width 768, top-8): 30.5B
    parameters (30.53B), 3.35B active (the model card's "3.3B"), 28.99B of them experts (95%). At
    TP 4 x EP 4 (SP) x PP 4 a rank holds 32 experts of each of its 12 layers whole (ETP 1) and a
    quarter of the rest; every push moves every expert once. (TP 4 x EP 4 on 8 GPUs does not fit
    under thunder: 7.7B parameters a rank -- expert parallelism inside the TP group divides the
    experts by at most the KV heads, 4.)"""
    shape = ModelShape.of(read_model_config(MOE, PolicyModelConfig(), "learner.model.hf_checkpoint"))
    assert round(shape.num_params / 1e9, 2) == 30.53 and round(shape.active_params / 1e9, 2) == 3.35
    expert = 48 * 128 * 3 * 768 * 2048
    assert shape.expert_params == expert and round(expert / shape.num_params, 3) == 0.950
    cfg = load_config(None, ["learner.model.hf_checkpoint=" + MOE, "learner.precision.params_dtype=bfloat16",
                             "learner.parallel.tensor_parallel=4", "learner.parallel.sequence_parallel=true",
                             "learner.parallel.expert_parallel=4", "learner.parallel.pipeline_parallel=4",
                             "learner.optimizer.use_distributed_optimizer=true",
                             "learner.activations.recompute=full", "agent.max_total_tokens=8192", "rollout.engine.deployment=server",
                             "ledger.slot_placement=host", "ledger.slot_budget_gb=64", "ledger.max_group_slots=null"])
    result = plan_cmd.run_plan(cfg, Machine(gpu_memory_gb=80.0, ranks_per_node=8, world=32))
    assert result.feasible, result.problems
    assert result.layout["expert_params_per_rank"] == expert // 16
    dense_shard = sum(stage_params(ModelShape.of(PolicyModelConfig(  # the same model with a 4-wide dense MLP
        family="qwen3", vocab_size=151936, hidden_size=2048, ffn_hidden_size=4, num_layers=48,
        num_attention_heads=32, num_query_groups=4, head_dim=128, tie_word_embeddings=False)), 4, 4, result.stage))
    dense_mlp = 12 * 3 * 4 * 2048 // 4
    router = 12 * 128 * 2048
    weights = {line.part: line.device for line in result.lines}["weights"]
    assert weights == (dense_shard - dense_mlp + router + expert // 16) * 2
    assert result.links["weight_push_expert_bytes_per_step"] == expert * 2
    assert round(result.links["weight_push_expert_bytes_per_step"] / result.links["weight_push_per_step"], 3) == 0.950


@pytest.mark.parametrize("overrides,expected", [
    ([f"learner.model.hf_checkpoint={MOE}", "learner.parallel.tensor_parallel=4", "learner.parallel.expert_parallel=4"],
     "learner.parallel.sequence_parallel: a mixture of experts under tensor_parallel=4 needs sequence parallelism"),
    (["learner.model.hf_checkpoint=" + qwen("7B"), "learner.parallel.tensor_parallel=2",
      "learner.parallel.sequence_parallel=true", "learner.parallel.expert_parallel=2"],
     "learner.parallel.expert_parallel: 2 for a dense model"),
])
def test_expert_layouts_the_model_does_not_allow_are_refused(overrides, expected):
    result = plan_cmd.run_plan(load_config(None, overrides), Machine(world=8))
    assert not result.feasible and result.problems[0].startswith(expected), result.problems


def test_pending_buffers_are_planned_within_the_slot_budget():
    """``ledger.max_pending``: the plan adds the pending buffers the ledger may hold -- the cap, or
    what the slot budget leaves after K slots (``pending_within_budget``) -- in the slots' placement."""
    from megathunder.streaming.buffers import pending_within_budget

    base = ["learner.model.hf_checkpoint=" + qwen("32B")]
    off = plan_cmd.run_plan(load_config(REPO / "launch/slurm/grpo_128gpu.yaml", base), H100)
    assert "ledger pending" not in {line.part for line in off.lines}  # off by default
    # K null takes the whole budget (4 slots of S and R): nothing is left for pending buffers
    full = plan_cmd.run_plan(load_config(REPO / "launch/slurm/grpo_128gpu.yaml", base + ["ledger.max_pending=null"]), H100)
    assert "ledger pending" not in {line.part for line in full.lines}
    capped = plan_cmd.run_plan(load_config(REPO / "launch/slurm/grpo_128gpu.yaml", base + ["ledger.max_pending=2", "ledger.max_group_slots=2"]), H100)
    (line,) = [line for line in capped.lines if line.part == "ledger pending"]
    buffer = sum(stage_params(shape_of("32B"), 8, 2, 1)) * 4
    assert line.host == 2 * pinned(buffer) and line.device == 0  # on the host (pinned: power-of-two rounded)
    rest = plan_cmd.run_plan(load_config(REPO / "launch/slurm/grpo_128gpu.yaml",
                                         base + ["ledger.max_pending=null", "ledger.max_group_slots=2"]), H100)
    (line,) = [line for line in rest.lines if line.part == "ledger pending"]
    assert line.host == pending_within_budget(None, 2, 64.0, buffer, 2) * pinned(buffer) > 0


SHIPPED_MODELS = {  # the launch configs' /models/... paths, as the fixtures' shapes
    "launch/slurm/grpo_128gpu.yaml": ["learner.model.hf_checkpoint=" + qwen("32B")],
    "launch/slurm/opd_128gpu.yaml": ["learner.model.hf_checkpoint=" + qwen("7B"),
                                     "objective.teacher.hf_checkpoint=" + qwen("32B")],
    "launch/slurm/swe_128gpu.yaml": ["learner.model.hf_checkpoint=" + qwen("32B")],
}


@pytest.mark.parametrize("config", sorted(str(p.relative_to(REPO)) for p in [*REPO.glob("configs/*.yaml"),
                                                                              *REPO.glob("launch/slurm/*.yaml")]))
def test_every_shipped_config_is_planned(config, capsys):
    """``megathunder plan`` on every config the repository ships (the CPU ones as CPU ranks, the
    cluster ones at their launch's world with their models' shapes): a table and a feasible plan,
    never a crash (it was: a TypeError on the tiny MoE of configs/quickstart_moe.yaml)."""
    cluster = config.startswith("launch/")
    argv = [str(REPO / config), *SHIPPED_MODELS.get(config, [])]
    argv += ["--world", "96", "--host-memory-gb", "2048"] if cluster else ["--cpu", "--host-memory-gb", "24"]
    status = plan_cmd.main(argv)
    out = capsys.readouterr().out.strip().splitlines()
    assert status == 0, out[-5:]
    assert out[0].startswith("layout: world") and json.loads(out[-1])["plan"]["feasible"]


def test_the_in_process_engine_on_a_learner_gpu_is_counted_and_refused_when_it_does_not_fit(capsys):
    """A single-node GPU run with the default in-process engine: vLLM takes 0.9 of learner rank 0's
    GPU, which the plan counts (it did not: "fits"), and refuses naming the field; with the engine
    on servers of its own the same layout fits; a share that leaves the learner room is planned."""
    argv = [str(REPO / "configs/quickstart.yaml"), "learner.model.hf_checkpoint=" + qwen("7B"),
            "learner.precision.params_dtype=bfloat16", "learner.parallel.tensor_parallel=4", "ledger.max_group_slots=0"]
    options = ["--world", "8", "--host-memory-gb", "2048"]
    assert plan_cmd.main([*argv, "rollout.engine.gpu_memory_utilization=0.9", *options]) == 1  # vLLM's default
    err = capsys.readouterr().err
    assert "rollout.engine.deployment: in_process puts vLLM on learner rank 0's GPU" in err, err
    assert plan_cmd.main([*argv, "rollout.engine.deployment=server", *options]) == 0
    capsys.readouterr()
    assert plan_cmd.main([*argv, "rollout.engine.gpu_memory_utilization=0.1", *options]) == 0
    out = capsys.readouterr().out
    assert "in-process engine" in out and json.loads(out.strip().splitlines()[-1])["plan"]["rollout_device"][
        "in-process engine"] == round(0.1 * 80 * GiB)


def test_sparse_patches_count_the_whole_model_copy_on_every_rollout_gpu(capsys):
    """``sparse_threshold`` > 0 keeps the whole model in checkpoint layout on each rollout GPU beside
    vLLM's share: ~61 GiB at 32B in bf16 -- refused at the shipped 0.85 (the plan never counted it)."""
    argv = [str(REPO / "launch/slurm/grpo_128gpu.yaml"), "learner.model.hf_checkpoint=" + qwen("32B"),
            "rollout.engine.weight_transfer.sparse_threshold=0.5", "--world", "96", "--host-memory-gb", "2048"]
    assert plan_cmd.main(argv) == 1
    err = capsys.readouterr().err
    assert "rollout.engine.weight_transfer.sparse_threshold: 0.5 keeps a copy of the whole model (61.0 GiB)" in err, err


def test_pinned_host_slots_are_planned_as_torch_rounds_them():
    """Host-placed slots are pinned on GPUs, and torch's host allocator rounds a pinned allocation up
    to a power of two: at 32B (TP8 x PP2) a 7.63 GiB slot takes 8 GiB. On CPU nothing is pinned."""
    from megathunder.plan.memory_plan import pinned

    assert pinned(3) == 4 and pinned(4) == 4 and pinned(7 * GiB + 1) == 8 * GiB and pinned(0) == 0
    cfg = load_config(REPO / "launch/slurm/grpo_128gpu.yaml", ["learner.model.hf_checkpoint=" + qwen("32B")])
    result = plan_cmd.run_plan(cfg, Machine(world=96, host_memory_gb=2048))
    slots = next(line for line in result.lines if line.part == "ledger slots")
    k = result.ledger_slots
    assert slots.host == (2 * k + 1) * 8 * GiB and "pinned" in slots.note


def test_a_run_with_the_in_process_engine_on_a_gpu_is_refused_unless_its_share_is_set():
    """Before anything starts (``megathunder train`` on a GPU machine): the default in-process engine
    would take 0.9 of learner rank 0's GPU; refused naming the field unless the share is set."""
    from megathunder.config import ConfigError
    from megathunder.trainer.run import check_engine_placement

    default = load_config(None, [])
    with pytest.raises(ConfigError, match="rollout.engine.deployment: in_process on a GPU"):
        check_engine_placement(default, cuda=True)
    check_engine_placement(default, cuda=False)  # CPU: vLLM's KV cache is its own memory
    check_engine_placement(load_config(None, ["rollout.engine.gpu_memory_utilization=0.2"]), cuda=True)
    check_engine_placement(load_config(None, ["rollout.engine.deployment=server"]), cuda=True)


def test_swe_launch_config_fits_with_its_sandbox_servers_counted_per_node(capsys):
    """launch/slurm/swe_128gpu.yaml (a 32B student, sandboxes on servers beside vLLM on 4 rollout
    nodes): the learner fits, and the servers' worst case per node -- 64 sandboxes x 2 CPUs over an
    overcommit of 2, 64 x 8 GiB -- fits a 96-CPU node beside vLLM's reserve; twice the sandboxes per
    server does not, and the plan names the fields."""
    config = [str(REPO / "launch/slurm/swe_128gpu.yaml"), "learner.model.hf_checkpoint=" + qwen("32B")]
    argv = [*config, "--world", "96", "--host-memory-gb", "2048", "--sandbox-nodes", "4", "--sandbox-node-cpus", "96",
            "--sandbox-reserved-cpus", "16", "--sandbox-reserved-memory-gb", "256"]
    assert plan_cmd.main(argv) == 0
    out = capsys.readouterr().out
    sandbox = json.loads(out.strip().splitlines()[-1])["plan"]["sandbox"]
    assert sandbox == {"num_servers": 4, "per_server": 64, "cpus_per_node": 64.0, "memory_bytes_per_node": 512 * GiB,
                       "free_cpus_per_node": 80, "free_memory_bytes_per_node": 1792 * GiB, "capacity": 256,
                       "episodes": 256}
    assert "256 at once for 256 concurrent episodes" in out
    assert plan_cmd.main([*config, "sandbox.max_sandboxes_per_server=128", *argv[2:]]) == 1
    err = capsys.readouterr().err
    assert ("sandbox.max_sandboxes_per_server: 128 sandboxes x sandbox.runtime.cpus=2 / sandbox.cpu_overcommit=2 = "
            "128.0 CPUs per node, but a sandbox node has 80 free") in err, err
    assert plan_cmd.main([*config, "sandbox.runtime.memory_mb=32768", *argv[2:]]) == 1
    assert "64 sandboxes x sandbox.runtime.memory_mb=32768 = 2048.0 GiB per node" in capsys.readouterr().err
