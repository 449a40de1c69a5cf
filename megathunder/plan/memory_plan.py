"""The memory and traffic of a learner layout, predicted from the model's shape and the config.

``plan(cfg, shape, machine)`` returns, for the most loaded learner rank (a GPU, or a CPU process),
what it holds at its peak, what each rank and each node holds in host memory, and the bytes each
step moves on each link; ``Plan.problems`` names what does not divide or does not fit. Nothing is built: this is
arithmetic, run before any server or rank starts (``megathunder plan``, the launch preflight).

Per rank, with P the parameters of the rank's pipeline stage (its TP shard: ``stage_params``), e
the bytes of ``learner.precision.params_dtype``:

(Mixture of experts: a MoE layer's MLP is its router, E x h, replicated, and its experts; a rank
holds E / EP whole experts, each's three matrices split over the ETP ranks: E / EP x 3 F_e h / ETP,
plus a shared expert's 3 F_s h / TP. P counts exactly that, so every line below covers experts;
``layout.expert_params_per_rank`` reports their part, ``links.weight_push_expert_bytes_per_step``
the experts' share of each push, which moves every expert once.)

    weights               P e
    gradients             4 P       DDP's buffers are fp32 (grad_reduce_in_fp32)
    optimizer             adam: (12 if bf16 else 8) P, sgd: (8 if bf16 else 4) P (fp32 main
                          params when bf16, moments); / DP with the distributed optimizer
    ledger (thunder)      P (and P_A) in fp32 + K_eff slots x (2, or 1 std-free) x P x slot bytes,
                          on the device or in host memory (+ one fp32 staging buffer on each side)
    activations           the longest allowed trajectory (agent.max_total_tokens), in flight on up
                          to min(PP - stage, micro-batches per schedule call) micro-batches (1F1B),
                          each packing up to r = max(1, learner.pack_tokens // s) trajectories
                          (rows x length <= pack_tokens; CP: r = 1), at most the call's trajectories
                          in all; the backward's working set is one micro-batch's r rows
    reference             P e, or in host memory with learner.reference.offload_to_cpu
    teacher, OPD state    the teacher's P_T e; per kept trajectory its K/V cache and the student's
                          retained segment graphs (objective.max_cached_trajectories)
    turn streams          per-turn score gradients (ledger.per_turn_scores kv_adjoint or
                          forward_early): per trajectory streamed by turns, its retained segment
                          graphs (ledger.max_turn_streams, max_pending, episodes in flight)
    weight push           each stage's sender: two buckets + its largest parameter gathered over TP,
                          in the engine's dtype (+ its shards as last pushed with sparse patches);
                          rpc: the serialised model on rank 0

The first three are Megatron's own accounting (``megatron/training/theoretical_memory_usage.py``:
18 bytes per parameter for bf16 + Adam, 6 + 12 / DP with the distributed optimizer);
``tests/unit/test_memory_plan.py`` checks ours against that formula.

Activations are counted tensor by tensor from what autograd saves in each layer of Megatron's
local spec (RMSNorm, SwiGLU, GQA, no dropout), per token of a trajectory, in units of e unless
marked; h hidden, F ffn, d head dim, a_t / g_t heads / query groups per TP rank, q = a_t d,
kv = g_t d, F_t = F / TP, s the sequence, sigma = TP under sequence parallelism else 1:

    2 norms               2 x (2 h / sigma  +  4 bytes / sigma)       input and normalised x, rstd
    linear inputs         2 h / sigma + q + F_t                      QKV, proj, fc1, fc2
    rotary                4 d                                         cos / sin of q and k
    SwiGLU                4 F_t                                       fc1 out, silu, product
    core attention        megatron: 3 q + a_t s + s bytes            q, K/V repeated per head,
                                                                      softmax probs, causal mask
                          sdpa / past_kv / TE: 3 q + 3 kv + 4 a_t bytes - q   q, k, the QKV output
                                                                      (v is a view of it), out (also
                                                                      the projection's input), lse
    recompute selective   core attention -> 2 q + 3 kv (+ q: the projection's input, no longer
                          shared)                                    its checkpointed inputs
                          mlp -> h / sigma                           (recompute_modules: mlp)
    recompute full        a checkpointed chunk of n layers keeps its input, h / sigma (and the
                          rotary table once, d); the backward recomputes one chunk at a time
                          (n layers' worth, transient)
    first stage           8 bytes (token ids); last stage: final norm + output-layer input
                          (3 h / sigma + 4 bytes / sigma) and the logprob's fp32 tensors
                          (2 + entropy) x V_t x 4 bytes (+ 13 bytes: logp, target index, mask)
    q/k norms (Qwen3)     2 q + kv + 4 (a_t + g_t) bytes (+ q + 2 kv unfused: the QKV output)

These coefficients are exact for the local spec: ``tests/unit/test_memory_plan.py`` sums the
bytes autograd saves (``saved_tensors_hooks``) in a real Megatron model and compares. The peak of a
backward adds the working set of the step being differentiated; measured on CPU (BENCHMARKS.md,
"megathunder plan vs measured peaks") it is about one layer's activations and, on the last stage,
three more copies of the fp32 logits (their gradient, the exp, the output layer's logits), which
the plan adds (``BACKWARD_LAYERS``, ``LOSS_BACKWARD_COPIES``). Transformer Engine's fused layers
are counted with the local formula and the fused-attention line: an estimate until a GPU run
calibrates it (``tools/gpu_check.sh``).

Traffic per rank, ring collectives (a ring all-reduce of B bytes sends 2 (n - 1) / n B per rank):
TP per trajectory 2 (t - 1) / t x s h e x (4 per layer, 6 with full recompute, +1 on the first and
last stage); PP per trajectory s h e / sigma each way per stage boundary; CP per trajectory and
layer 3 (cp - 1) / cp x 2 s kv e (K/V forward, K/V and their gradients backward); the DP gradient
reduce per step 2 (n - 1) / n x 4 P (all-reduce) or (n - 1) / n x (4 P + e P) (distributed
optimizer: reduce-scatter of the gradients, all-gather of the parameters); the weight push per
step the model's inference bytes once (collective broadcast) or once per server (rpc).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from megathunder.config import (
    Config,
    ConfigError,
    DistillObjective,
    ParallelConfig,
    PolicyModelConfig,
    RLObjective,
    check_experts_divide_model,
    check_parallel_divides_model,
)
from megathunder.config.rollout_config import CollectiveTransfer

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
BACKWARD_LAYERS = 1.0  # the working set of one layer's backward, in layers of activations
LOSS_BACKWARD_COPIES = 1.25  # fp32 [s, V/t] tensors live at the loss backward besides the saved ones
GPU_RUNTIME_GIB = 4.0  # CUDA context, NCCL communicators, allocator slack (an estimate)
GPU_PROCESS_HOST_GIB = 3.0  # host RSS of one CUDA learner process (torch, megatron; an estimate)
CONTROLLER_HOST_GIB = 2.0  # rank 0's controller: agent loop, engine client, journal (an estimate)
RPC_COPIES = 2 + 4 / 3  # rpc push on rank 0: the tensors, their safetensors bytes, base64 text


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder that memory depends on (``experts``
0: a dense MLP)."""

    vocab: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tie: bool
    qkv_bias: bool
    qk_norm: bool
    experts: int = 0  # routed experts per layer (0: dense)
    topk: int = 0  # experts per token
    expert_ffn: int = 0  # each expert's SwiGLU width
    shared_ffn: int = 0  # a shared expert's width (0: none)

    @classmethod
    def of(cls, m: PolicyModelConfig) -> ModelShape:
        return cls(vocab=m.vocab_size, hidden=m.hidden_size, ffn=m.ffn_hidden_size, layers=m.num_layers,
                   heads=m.num_attention_heads, kv_heads=m.num_query_groups,
                   head_dim=m.head_dim or m.hidden_size // m.num_attention_heads, tie=m.tie_word_embeddings,
                   qkv_bias=m.qkv_bias, qk_norm=m.qk_norm,
                   experts=m.num_experts or 0, topk=m.moe_router_topk if m.num_experts else 0,
                   expert_ffn=m.expert_ffn_hidden_size if m.num_experts else 0,
                   shared_ffn=m.moe_shared_expert_intermediate_size or 0)

    @property
    def num_params(self) -> int:
        """The whole model's parameters."""
        return sum(stage_params(self, 1, 1, 0))

    @property
    def expert_params(self) -> int:
        """The whole model's routed-expert parameters."""
        return expert_stage_params(self, 1, 1, 1)

    @property
    def active_params(self) -> int:
        """Parameters one token goes through: all but the experts it is not routed to."""
        if not self.experts:
            return self.num_params
        return self.num_params - self.expert_params * (self.experts - self.topk) // self.experts


def read_model_config(path: str | Path, base: PolicyModelConfig, field_name: str) -> PolicyModelConfig:
    """Sizes from a Hugging Face ``config.json``: ``path`` is the model directory or that file."""
    path = Path(path)
    directory = path.parent if path.name == "config.json" else path
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{field_name}: no config.json at {path} (a Hugging Face model directory or its "
                          "config.json)")
    from megathunder.learner.model import policy_config_from_hf  # the learner's own reading of it

    try:
        return policy_config_from_hf(directory, base)
    except ConfigError as err:
        raise ConfigError(str(err).replace("learner.model.hf_checkpoint", field_name)) from None


def stage_params(shape: ModelShape, tp: int, pp: int, stage: int, ep: int = 1,
                 etp: int | None = None) -> tuple[int, int, int]:
    """(transformer layers, embedding + output layer, final norm) parameters of one TP shard of
    pipeline stage ``stage`` -- the tensors Megatron's GPTModel builds there (a MoE layer's: its
    router and this rank's E / ``ep`` experts, each split over ``etp`` = TP / EP ranks by default)."""
    h, d, t = shape.hidden, shape.head_dim, tp
    qkv_out = (shape.heads + 2 * shape.kv_heads) * d
    if shape.experts:
        mlp = shape.experts * h + 3 * shape.shared_ffn * h // t  # router (replicated), shared expert
    else:
        mlp = 2 * shape.ffn * h // t + shape.ffn * h // t  # fc1 (gate, up), fc2
    per_layer = (2 * h  # input and pre-MLP RMSNorm (replicated)
                 + qkv_out * h // t + (qkv_out // t if shape.qkv_bias else 0)
                 + (2 * d if shape.qk_norm else 0)
                 + shape.heads * d * h // t  # output projection
                 + mlp)
    layers = per_layer * shape.layers // pp + expert_stage_params(shape, pp, ep, etp or max(tp // ep, 1))
    embed = shape.vocab // t * h
    first, last = stage == 0, stage == pp - 1
    vocab = 0
    if first:
        vocab += embed
    if last and (not shape.tie or pp > 1):  # untied output layer, or the tied copy on the last stage
        vocab += embed
    return layers, vocab, h if last else 0


def expert_stage_params(shape: ModelShape, pp: int, ep: int, etp: int) -> int:
    """Routed-expert parameters one rank of a pipeline stage holds: E / ``ep`` experts of its
    layers, each's gate, up and down matrices split over ``etp`` ranks."""
    if not shape.experts:
        return 0
    return shape.layers // pp * shape.experts // ep * 3 * shape.expert_ffn * shape.hidden // etp


# ---------------------------------------------------------------------- activations


@dataclass(frozen=True)
class ActivationModel:
    """What one trajectory's forward keeps for its backward on one rank (module docstring)."""

    shape: ModelShape
    tp: int
    sp: bool
    cp: int
    e: int  # activation bytes
    attention: str  # "megatron" (unfused), "fused" (sdpa / past_kv / Transformer Engine)
    recompute: str = "none"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    recompute_modules: tuple[str, ...] = ("core_attn",)
    entropy: bool = False
    ep: int = 1  # MoE: expert parallelism
    etp: int = 1  # MoE: expert-tensor parallelism

    @property
    def _dims(self) -> tuple[int, float, int, int, float]:
        t = self.tp
        sigma = t if self.sp else 1
        a_t = self.shape.heads // t
        g_t = max(self.shape.kv_heads // t, 1)
        return t, sigma, a_t, g_t, self.shape.ffn / t

    def layer_bytes(self, s: float, recompute: bool = True) -> float:
        """Bytes one transformer layer keeps for a local sequence of ``s`` tokens (this CP rank's
        share), without full recompute's chunking."""
        sh, e = self.shape, self.e
        _, sigma, a_t, g_t, f_t = self._dims
        h, d = sh.hidden, sh.head_dim
        q, kv = a_t * d, g_t * d
        s_keys = s * self.cp  # attention reads every position's keys (other CP ranks' via TE)
        norms = 2 * (2 * h / sigma * e + 4 / sigma)
        if sh.qk_norm:  # q and k RMSNorm (Qwen3): q's input (a copy), both normalised, rstd per head; k's
            # input is a view of the QKV output, which the fused kernel's v keeps anyway, the unfused one not
            norms += (2 * q + kv + (0 if self.attention != "megatron" else q + 2 * kv)) * e + 4 * (a_t + g_t)
        linear_in = (2 * h / sigma + q + f_t) * e
        rotary = 4 * d * e
        mlp = 4 * f_t * e
        if sh.experts:
            linear_in, mlp = self._moe_mlp(h, q, sigma)
        if self.attention == "megatron":
            core = 3 * q * e + a_t * s_keys * e + s_keys
        else:  # the projection's input is the kernel's saved output (the same storage)
            core = (3 * q + 3 * kv) * e + 4 * a_t
            linear_in -= q * e
        if recompute and self.recompute == "selective":
            if "core_attn" in self.recompute_modules:
                if self.attention != "megatron":
                    linear_in += q * e  # the output is recomputed; the projection keeps its own input
                core = (2 * q + 3 * kv) * e
            if "mlp" in self.recompute_modules:
                mlp = 0.0
                linear_in -= (h / sigma + f_t) * e  # fc1 and fc2 inputs go with the MLP ...
                linear_in += h / sigma * e  # ... whose checkpoint keeps its input
        return s * (norms + linear_in + rotary + mlp + core)

    def _moe_mlp(self, h: int, q: int, sigma: float) -> tuple[float, float]:
        """(linear inputs, MLP) per token of a MoE layer -- an estimate assuming balanced routing
        (the real count depends on how many tokens each rank's experts receive). The router keeps
        its input (the pre-MLP norm's output, h / sigma) and its fp32 logits and scores
        (2 E x 4 bytes / sigma); each of a token's k assignments, on the rank of its expert (k / EP
        per token on each rank: the all-gather dispatcher gathers the TP group's tokens), keeps the
        permuted input h, the SwiGLU tensors 4 F_e / ETP and fc2's input F_e / ETP, the expert's
        output before its routing weight (h) and the weight (4 bytes); a shared expert is a dense
        SwiGLU of F_s / TP."""
        sh, e = self.shape, self.e
        per_rank = sh.topk / self.ep
        fe_t = sh.expert_ffn / self.etp
        fs_t = sh.shared_ffn / self.tp
        linear_in = (2 * h / sigma + q) * e + per_rank * (h + fe_t) * e + (fs_t * e if fs_t else 0.0)
        mlp = 2 * sh.experts * 4 / sigma + per_rank * (4 * fe_t * e + h * e + 4) + 4 * fs_t * e
        return linear_in, mlp

    def stage_bytes(self, s: int, layers: int, first: bool, last: bool) -> dict[str, float]:
        """Stored bytes of one micro-batch of ``s`` tokens (the whole sequence) on a stage, and the
        backward's working set on top (module docstring)."""
        sh, e = self.shape, self.e
        _, sigma, a_t, _, _ = self._dims
        local = s / self.cp
        layer = self.layer_bytes(local)
        layer_full = self.layer_bytes(local, recompute=False)
        keep = local * sh.hidden / sigma * e
        probs = local * a_t * (s if self.attention == "megatron" else 0) * e  # one [a_t, s, s] tensor, unfused
        mask = local * s if self.attention == "megatron" else 0.0
        grads = 2 * probs  # the gradients of the probabilities and of the scores
        if self.recompute == "full":
            n = self.recompute_num_layers
            freqs = local * sh.head_dim * e  # the rotary table, an input of every checkpoint (one storage)
            if self.recompute_method == "uniform":
                stored = layers / n * keep + freqs
                working = n * layer_full + grads
            else:
                stored = n * keep + (layers - n) * layer_full + freqs
                working = layer_full + grads
        elif self.recompute == "selective" and "core_attn" in self.recompute_modules and self.attention == "megatron":
            stored = layers * layer
            working = layer + probs + mask + grads  # the attention recomputed, then differentiated
        elif self.recompute == "selective":
            stored = layers * layer
            working = layer_full
        else:
            stored = layers * layer
            working = layer - probs - mask + grads if self.attention == "megatron" else BACKWARD_LAYERS * layer
        if first:
            stored += 8 * local
        logits = 0.0
        if last:
            vocab_t = sh.vocab / self.tp
            stored += local * (3 * sh.hidden / sigma * e + 4 / sigma)
            logits = local * (vocab_t * 4 * (2 + (1 if self.entropy else 0)) + 13)  # + logp, target index, mask
            working = max(working, local * vocab_t * 4 * LOSS_BACKWARD_COPIES)
        return {"layers": stored, "logits": logits, "backward": working}


# ---------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Machine:
    """Where the learner runs: GPUs of ``gpu_memory_gb`` (None: CPU processes, whose memory is the
    host's), ``ranks_per_node`` learner ranks on nodes of ``host_memory_gb``."""

    gpu_memory_gb: float | None = 80.0
    ranks_per_node: int = 8
    host_memory_gb: float = 2048.0
    world: int | None = None  # learner ranks; None: the config's data_parallel (or 1)
    process_host_gb: float | None = None  # per-process host baseline (None: the estimate for GPUs, 0 on CPU)


@dataclass
class Line:
    part: str
    device: float = 0.0  # bytes on the rank's GPU (on CPU: in the process)
    host: float = 0.0  # bytes in host memory per rank
    note: str = ""
    rank0_only: bool = False  # held by global rank 0 alone (counted once per node)


@dataclass
class Plan:
    layout: dict
    lines: list[Line] = field(default_factory=list)
    node_host: list[Line] = field(default_factory=list)  # per node (rank 0's node: the most)
    links: dict[str, float] = field(default_factory=dict)  # bytes
    problems: list[str] = field(default_factory=list)
    ledger_slots: int | None = None
    stage: int = 0  # the most loaded pipeline stage
    rank0: list[Line] = field(default_factory=list)  # what global rank 0 holds alone (stage 0)
    rollout: list[Line] = field(default_factory=list)  # the rollout engine's share of GPUs (``_rollout_lines``)

    @property
    def device_total(self) -> float:
        return sum(line.device for line in self.lines)

    @property
    def host_rank_total(self) -> float:
        return sum(line.host for line in self.lines)

    @property
    def node_host_total(self) -> float:
        return sum(line.host for line in self.node_host)

    @property
    def feasible(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {
            "feasible": self.feasible, "problems": self.problems, "layout": self.layout,
            "ledger_slots": self.ledger_slots, "stage": self.stage,
            "device_bytes": round(self.device_total), "host_bytes_per_rank": round(self.host_rank_total),
            "node_host_bytes": round(self.node_host_total),
            "device": {line.part: round(line.device) for line in self.lines if line.device},
            "host": {line.part: round(line.host) for line in self.lines if line.host},
            "node_host": {line.part: round(line.host) for line in self.node_host},
            "links": {k: round(v) for k, v in self.links.items()},
            "rollout_device": {line.part: round(line.device) for line in self.rollout},
        }


def plan(cfg: Config, shape: ModelShape, machine: Machine, teacher: ModelShape | None = None) -> Plan:
    """The memory of ``cfg``'s learner layout for a model of ``shape`` on ``machine`` (see module)."""
    par, learner = cfg.learner.parallel, cfg.learner
    tp, pp, cp = par.tensor_parallel, par.pipeline_parallel, par.context_parallel
    ep, etp = par.expert_parallel, par.expert_tensor_parallel_size
    world = machine.world
    problems: list[str] = []
    if world is None:
        world = tp * pp * cp * (par.data_parallel or 1)
    if world % (tp * pp * cp):
        problems.append(f"learner.parallel: world size {world} is not a multiple of tensor_parallel x "
                        f"pipeline_parallel x context_parallel = {tp} x {pp} x {cp}")
    dp = max(world // (tp * pp * cp), 1)
    if par.data_parallel is not None and par.data_parallel != dp and not problems:
        problems.append(f"learner.parallel.data_parallel: {par.data_parallel}, but world size {world} gives {dp}")
    span = par.expert_data_span  # DP ranks one expert grid spans (EP drawn from DP)
    if span > 1 and dp % span and not problems:
        problems.append(f"learner.parallel.expert_parallel: the expert grid {ep} x {etp} spans {span} data-parallel "
                        f"ranks, which does not divide the data-parallel size {dp}")
    layout = {"world": world, "tp": tp, "pp": pp, "cp": cp, "dp": dp, "sp": par.sequence_parallel,
              "params": shape.num_params}
    if shape.experts:
        layout.update(ep=ep, etp=etp, experts=shape.experts, topk=shape.topk, active_params=shape.active_params,
                      expert_params=shape.expert_params,
                      expert_params_per_rank=max(expert_stage_params(shape, pp, ep, etp) for _ in range(pp)))
    out = Plan(layout=layout, problems=problems)
    divides = _divides(shape, tp, pp, cp, par.cp_comm_type, "learner.model") or _experts_divide(shape, par)
    if divides is None and teacher is not None:  # the teacher runs in the student's layout
        divides = _divides(teacher, tp, 1, cp, par.cp_comm_type, "objective.teacher")
    if divides:
        out.problems.append(divides)
        return out
    e = DTYPE_BYTES[learner.precision.params_dtype]
    gpu = machine.gpu_memory_gb is not None
    s = cfg.agent.max_total_tokens
    s_padded = _pad(s, (tp if par.sequence_parallel else 1) * (2 * cp if cp > 1 else 1))
    thunder = cfg.schedule.mode == "thunder"
    obj = cfg.objective
    rl = obj if isinstance(obj, RLObjective) else None
    act = ActivationModel(
        shape=shape, tp=tp, sp=par.sequence_parallel, cp=cp, e=e,
        attention="megatron" if learner.precision.attention == "megatron" and learner.precision.layer_spec == "local"
        else "fused",
        recompute=learner.activations.recompute, recompute_method=learner.activations.recompute_method,
        recompute_num_layers=learner.activations.recompute_num_layers,
        recompute_modules=tuple(learner.activations.recompute_modules),
        entropy=rl is not None and rl.entropy_coef > 0, ep=ep, etp=etp)
    group = cfg.batch.samples_per_prompt
    per_rank = -(-cfg.batch.num_prompts_per_batch * group // dp)
    # most trajectories in one schedule call: the batch's (sync), or what one release of held ready
    # work sends (thunder: the members of every group closed meanwhile, up to the rank's batch)
    calls = per_rank
    rows = min(max(1, learner.pack_tokens // s_padded) if cp == 1 else 1, calls)  # trajectories per micro-batch

    best: tuple[float, int, list[Line]] | None = None
    rank0: list[Line] = []
    stage0_device = 0.0
    for stage in range(pp):
        micro = min((pp - stage) * rows, calls)  # 1F1B: stage r holds up to pp - r micro-batches' activations
        lines = _rank_lines(cfg, shape, act, stage, tp, pp, dp, e, s_padded, micro, gpu, out, teacher, rows)
        total = sum(line.device for line in lines)
        if stage == 0:
            rank0 = [line for line in lines if line.rank0_only]
            stage0_device = total
        if best is None or total > best[0]:
            best = (total, stage, lines)
    assert best is not None
    _, out.stage, out.lines = best
    out.rank0 = rank0
    if gpu:
        out.lines.append(Line("runtime", device=GPU_RUNTIME_GIB * GiB, note="CUDA context, NCCL, allocator (estimate)"))
    baseline = machine.process_host_gb
    if baseline is None:
        baseline = GPU_PROCESS_HOST_GIB if gpu else 0.0
    out.lines.append(Line("process", host=baseline * GiB, note="torch, megatron, CUDA host side" if gpu else
                          "measured separately on CPU"))
    _node_host(out, machine, gpu)
    _links(out, cfg, shape, tp, pp, cp, dp, e, s_padded, per_rank)
    if gpu:
        _rollout_lines(out, cfg, shape, machine, stage0_device + GPU_RUNTIME_GIB * GiB)
    _fit(out, machine, gpu)
    return out


def _rollout_lines(out: Plan, cfg: Config, shape: ModelShape, machine: Machine, rank0_device: float) -> None:
    """What the rollout engine holds on GPUs the plan must see (``Plan.rollout``): an in-process
    engine shares learner rank 0's GPU (vLLM takes ``gpu_memory_utilization`` of it); with sparse
    patches every rollout worker keeps the whole model in checkpoint layout, outside vLLM's share."""
    assert machine.gpu_memory_gb is not None
    engine, budget = cfg.rollout.engine, machine.gpu_memory_gb * GiB
    vllm = engine.gpu_memory_utilization * budget
    if engine.deployment == "in_process":
        out.rollout.append(Line("in-process engine", device=vllm,
                                note=f"vLLM on learner rank 0's GPU: rollout.engine.gpu_memory_utilization "
                                     f"{engine.gpu_memory_utilization:g}"))
        if rank0_device + vllm > budget:
            out.problems.append(
                f"rollout.engine.deployment: in_process puts vLLM on learner rank 0's GPU, which then needs "
                f"{(rank0_device + vllm) / GiB:.1f} GiB of {machine.gpu_memory_gb:g} (the learner's "
                f"{rank0_device / GiB:.1f} + vLLM's {engine.gpu_memory_utilization:g} x {machine.gpu_memory_gb:g}); "
                "use deployment=server on GPUs of their own (the launch scripts do), or a "
                "rollout.engine.gpu_memory_utilization that leaves the learner its share")
    wt = engine.weight_transfer
    if isinstance(wt, CollectiveTransfer) and wt.sparse_threshold > 0:
        copy = shape.num_params * (4 if engine.dtype == "float32" else 2)
        out.rollout.append(Line("sparse-patch copy", device=copy,
                                note="each rollout worker's copy of the whole model (checkpoint layout)"))
        if vllm + copy > budget:
            out.problems.append(
                f"rollout.engine.weight_transfer.sparse_threshold: {wt.sparse_threshold:g} keeps a copy of the whole "
                f"model ({copy / GiB:.1f} GiB) on every rollout GPU beside vLLM's "
                f"{engine.gpu_memory_utilization:g} x {machine.gpu_memory_gb:g} GiB; use 0 (dense pushes)")


def pinned(nbytes: int) -> int:
    """What torch's caching host allocator takes for a pinned allocation of ``nbytes``: the next power
    of two (its round-up threshold defaults to unbounded; one allocation per ledger buffer, one
    tensor per DDP bucket: an estimate when a buffer has several)."""
    return 1 << max(int(nbytes) - 1, 0).bit_length() if nbytes > 0 else 0


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _divides(shape: ModelShape, tp: int, pp: int, cp: int, cp_comm: str, prefix: str) -> str | None:
    m = PolicyModelConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn,
                          num_layers=shape.layers, num_attention_heads=shape.heads, num_query_groups=shape.kv_heads,
                          head_dim=shape.head_dim)
    try:
        check_parallel_divides_model(m, tp, pp, cp, cp_comm)
    except ValueError as err:
        text = str(err).replace("model.", f"{prefix}.")
        return f"learner.{text}"
    return None


def _experts_divide(shape: ModelShape, par: ParallelConfig) -> str | None:
    """The expert layout against the model's experts (config.json is read after the config parsed)."""
    m = PolicyModelConfig(family="qwen3_moe" if shape.experts else "qwen2", num_experts=shape.experts or None,
                          moe_router_topk=shape.topk or 2, moe_ffn_hidden_size=shape.expert_ffn or None,
                          num_attention_heads=shape.heads, num_query_groups=shape.kv_heads, head_dim=shape.head_dim)
    try:
        check_experts_divide_model(m, par)
    except ValueError as err:
        return f"learner.{err}"
    return None


def _rank_lines(cfg: Config, shape: ModelShape, act: ActivationModel, stage: int, tp: int, pp: int, dp: int,
                e: int, s: int, micro: int, gpu: bool, out: Plan, teacher: ModelShape | None,
                rows: int = 1) -> list[Line]:
    """``micro``: trajectories whose activations are in flight at once; ``rows``: of one micro-batch."""
    learner, obj = cfg.learner, cfg.objective
    par = learner.parallel
    layers_p, vocab_p, norm_p = stage_params(shape, tp, pp, stage, par.expert_parallel, par.expert_tensor_parallel_size)
    p = layers_p + vocab_p + norm_p
    experts = expert_stage_params(shape, pp, par.expert_parallel, par.expert_tensor_parallel_size)
    lines = [Line("weights", device=p * e, note=f"{p / 1e6:,.1f}M params x {e} B" + (
        f" ({experts / 1e6:,.1f}M of them experts: {shape.experts // par.expert_parallel} of {shape.experts} per rank)"
        if experts else ""))]
    lines.append(Line("gradients", device=p * 4, note="DDP buffers, fp32"))
    opt = learner.optimizer
    mixed = e < 4
    per_param = (12 if mixed else 8) if opt.name == "adam" else (8 if mixed else 4)
    shard = dp if opt.use_distributed_optimizer else 1
    lines.append(Line("optimizer", device=p * per_param / shard,
                      note=f"{opt.name}: {per_param} B/param" + (f" / DP {dp}" if shard > 1 else "")))
    rl = obj if isinstance(obj, RLObjective) else None
    if cfg.schedule.mode == "thunder" and rl is not None:
        lines.extend(_ledger_lines(cfg, rl, p, gpu, out))
        lines.extend(_turn_stream_lines(cfg, shape, act, tp, e, s))
    stored = act.stage_bytes(s, shape.layers // pp, stage == 0, stage == pp - 1)
    recompute = learner.activations.recompute
    lines.append(Line("activations", device=micro * stored["layers"] + rows * stored["backward"],
                      note=f"{s} tokens x {micro} in flight{f' ({rows} per micro-batch)' if rows > 1 else ''}, "
                           f"recompute {recompute}, "
                           f"{'SP, ' if act.sp else ''}{act.attention} attention"))
    if stored["logits"]:
        lines.append(Line("logits", device=micro * stored["logits"],
                          note="fp32 logprob tensors [s, V/tp] at every position: an upper bound "
                               "(learner.loss_logits_only keeps the loss's targets only)"))
    if rl is not None and rl.kl_coef > 0:
        offload = learner.reference.offload_to_cpu and gpu
        lines.append(Line("reference", device=0 if offload else p * e, host=p * e if offload else 0,
                          note="frozen policy copy" + (", offloaded" if offload else "")))
    if isinstance(obj, DistillObjective):
        lines.extend(_distill_lines(cfg, obj, shape, act, tp, e, s, teacher))
    wt = cfg.rollout.engine.weight_transfer
    if isinstance(wt, CollectiveTransfer):  # every stage's (TP 0, DP 0) rank sends its own tensors
        engine_e = 4 if cfg.rollout.engine.dtype == "float32" else 2  # auto: the checkpoint's bf16
        buckets = 2 * wt.bucket_mb * 2**20  # one packed while the other is on the wire
        gathered = largest_param(shape, pp, stage) * engine_e
        previous = p * engine_e if wt.sparse_threshold > 0 else 0  # sparse: shards as last pushed
        push = buckets + gathered + previous
        lines.append(Line("weight push", device=push if gpu else 0, host=0 if gpu else push,
                          note=f"stage sender: two {wt.bucket_mb:g} MiB buckets + one gathered parameter "
                               f"({gathered / 2**20:,.0f} MiB)" + (" + the pushed shards (sparse)" if previous else "")))
    elif stage == 0:  # global rank 0 gathers the model and sends it
        model_bytes = shape.num_params * 2
        lines.append(Line("weight push", host=RPC_COPIES * model_bytes, rank0_only=True,
                          note="rank 0: the serialised model (rpc)"))
    return lines


def largest_param(shape: ModelShape, pp: int, stage: int) -> int:
    """Elements of the stage's largest parameter gathered over TP (a push sender holds one): the
    embedding / output layer where the stage has one, else the fused QKV or gate-up weight."""
    h = shape.hidden
    layer = max((shape.heads + 2 * shape.kv_heads) * shape.head_dim * h, 2 * shape.ffn * h, shape.heads * shape.head_dim * h)
    _, vocab, _ = stage_params(shape, 1, pp, stage)  # the stage's embedding / output layer, unsharded
    return max(layer, shape.vocab * h if vocab else 0)


def _ledger_lines(cfg: Config, rl: RLObjective, p: int, gpu: bool, out: Plan) -> list[Line]:
    led = cfg.ledger
    from megathunder.objectives import coef_known_before_close  # light: no torch at import

    std_free = coef_known_before_close(rl) and not led.hold_groups_until_close
    per_slot = 1 if std_free else 2
    grad_bytes = p * 4
    slot_bytes = p * (2 if led.slot_dtype == "bfloat16" else 4)
    k = led.max_group_slots
    if led.slot_budget_gb is not None:
        fit = int(led.slot_budget_gb * GiB) // (per_slot * slot_bytes)
        k = fit if k is None else min(k, fit)
    groups = cfg.batch.num_prompts_per_batch
    k_eff = groups if k is None else min(k, groups)
    out.ledger_slots = k
    accumulators = 1 + (1 if rl.advantage == "batch_std" else 0)
    lines = [Line("ledger P", device=accumulators * grad_bytes, note="fp32 accumulator" + ("s" if accumulators > 1 else ""))]
    slots = k_eff * per_slot * slot_bytes
    where = f"{led.slot_placement}, {'bf16' if led.slot_dtype == 'bfloat16' else 'fp32'}"
    note = f"K = {k_eff} x {per_slot} buffers ({where})"
    if led.slot_placement == "host":
        staging = grad_bytes if k_eff else 0
        if gpu:  # pinned: torch's host allocator rounds every allocation up to a power of two
            slots, note = k_eff * per_slot * pinned(slot_bytes), note + ", pinned (power-of-two rounded)"
        lines.append(Line("ledger slots", device=staging if gpu else 0,
                          host=slots + (pinned(staging) if gpu else staging), note=note + " + fp32 staging"))
    else:
        lines.append(Line("ledger slots", device=slots, note=note))
    pending = led.max_pending  # gradients before the reward: the budget's rest after K slots
    if pending != 0 and led.slot_budget_gb is not None:
        rest = max(int(led.slot_budget_gb * GiB) // slot_bytes - (k or 0) * per_slot, 0)
        pending = rest if pending is None else min(pending, rest)
    if pending is None:  # no budget: one per trajectory of the batch at most
        pending = groups * cfg.batch.samples_per_prompt
    if pending:
        size, note = pending * slot_bytes, f"max_pending = {pending} buffers ({where})"
        if led.slot_placement == "host" and gpu:
            size, note = pending * pinned(slot_bytes), note + ", pinned (power-of-two rounded)"
        if led.slot_placement == "host":
            lines.append(Line("ledger pending", host=size, note=note))
        else:
            lines.append(Line("ledger pending", device=size, note=note))
    return lines


def _turn_stream_lines(cfg: Config, shape: ModelShape, act: ActivationModel, tp: int, e: int, s: int) -> list[Line]:
    """Per-turn score gradients with a K/V strategy: each trajectory streamed by turns keeps its
    segments' graphs until it ends, as OPD's kept trajectories do (``ledger.max_turn_streams``, else
    bounded by the pending buffers and the episodes in flight)."""
    led = cfg.ledger
    if led.per_turn_scores in ("off", "recompute"):
        return []
    bounds = [cfg.agent.max_concurrent_episodes, cfg.batch.num_prompts_per_batch * cfg.batch.samples_per_prompt]
    bounds += [b for b in (led.max_turn_streams, led.max_pending) if b is not None]
    kept = min(bounds)
    student = act.stage_bytes(s, shape.layers, True, True)
    kv = shape.layers * 2 * max(shape.kv_heads // tp, 1) * shape.head_dim * e
    per_traj = student["layers"] + student["logits"] + cfg.agent.max_turns * s * kv  # + past K/V copies, gradients
    return [Line("turn streams", device=kept * per_traj,
                 note=f"{kept} x retained segment graphs ({led.per_turn_scores}); the rest at finish")]


def _distill_lines(cfg: Config, obj: DistillObjective, shape: ModelShape, act: ActivationModel, tp: int, e: int,
                   s: int, teacher: ModelShape | None) -> list[Line]:
    lines = []
    t_shape = teacher or shape
    layers_t, vocab_t, norm_t = stage_params(t_shape, tp, 1, 0)
    p_t = layers_t + vocab_t + norm_t
    lines.append(Line("teacher", device=p_t * e, note=f"{p_t / 1e6:,.1f}M params x {e} B (of {t_shape.num_params / 1e9:.2f}B)"))
    kept = obj.max_cached_trajectories
    if kept is None:
        kept = cfg.agent.max_concurrent_episodes
    kv_t = t_shape.layers * 2 * max(t_shape.kv_heads // tp, 1) * t_shape.head_dim * e
    lines.append(Line("teacher K/V", device=kept * s * kv_t, note=f"{kept} kept trajectories x {s} tokens"))
    if obj.strategy != "recompute":
        student = act.stage_bytes(s, shape.layers, True, True)
        kv_s = shape.layers * 2 * max(shape.kv_heads // tp, 1) * shape.head_dim * e
        copies = (cfg.agent.max_turns - 1 + 1) * s * kv_s  # past K/V re-concatenated per turn, and their gradients
        per_traj = student["layers"] + student["logits"] + copies
        lines.append(Line("OPD state", device=kept * per_traj,
                          note=f"{kept} x retained segment graphs ({obj.strategy}); the rest recompute"))
    lines.append(Line("teacher forward", device=s * shape.vocab / tp * 4 * 2, note="logits of one segment"))
    return lines


def _node_host(out: Plan, machine: Machine, gpu: bool) -> None:
    """Rank 0's node: every rank's host lines (and on CPU its process memory), rank 0's own once."""
    shared = [line for line in out.lines if not line.rank0_only]
    per_rank = sum(line.host for line in shared) + (0 if gpu else sum(line.device for line in shared))
    ranks = min(machine.ranks_per_node, out.layout["world"])
    out.node_host = [Line(f"{ranks} ranks", host=ranks * per_rank,
                          note="host lines of each rank" + ("" if gpu else " + its process memory (CPU ranks)"))]
    for line in out.rank0:
        out.node_host.append(Line(line.part, host=line.host + (0 if gpu else line.device), note=line.note))
    out.node_host.append(Line("controller (rank 0)", host=CONTROLLER_HOST_GIB * GiB, note="estimate"))


def _links(out: Plan, cfg: Config, shape: ModelShape, tp: int, pp: int, cp: int, dp: int, e: int, s: int,
           per_rank: int) -> None:
    h = shape.hidden
    layers = shape.layers // pp
    full = cfg.learner.activations.recompute == "full"
    sigma = tp if cfg.learner.parallel.sequence_parallel else 1
    ring = lambda n: 2 * (n - 1) / n if n > 1 else 0.0  # noqa: E731
    links = out.links
    links["tp_per_trajectory"] = ring(tp) * s * h * e * (layers * (6 if full else 4) + 2)
    links["pp_per_trajectory"] = 2 * s * h * e / sigma if pp > 1 else 0.0
    kv = max(shape.kv_heads // tp, 1) * shape.head_dim
    links["cp_per_trajectory"] = 3 * (cp - 1) / cp * 2 * s * kv * e * layers if cp > 1 else 0.0
    par = cfg.learner.parallel
    p = sum(stage_params(shape, tp, pp, out.stage, par.expert_parallel, par.expert_tensor_parallel_size))
    reducers = dp * cp  # experts: the expert-data-parallel group, DP x CP ranks too (EP x ETP = TP)
    if cfg.learner.optimizer.use_distributed_optimizer:
        links["dp_reduce_per_step"] = ring(reducers) / 2 * (4 * p + e * p)
    else:
        links["dp_reduce_per_step"] = ring(reducers) * 4 * p
    model_bytes = shape.num_params * 2
    servers = max(len(cfg.rollout.engine.server_urls), cfg.rollout.engine.num_servers)
    wt = cfg.rollout.engine.weight_transfer
    links["weight_push_per_step"] = model_bytes * (1 if isinstance(wt, CollectiveTransfer) else servers)
    if shape.experts:  # every expert moves on every push: the bulk of a MoE model's bytes
        links["weight_push_expert_bytes_per_step"] = (shape.expert_params * 2
                                                      * (1 if isinstance(wt, CollectiveTransfer) else servers))
    links["trajectories_per_rank_per_step"] = per_rank
    links["tp_per_step_at_max_length"] = links["tp_per_trajectory"] * per_rank


def _fit(out: Plan, machine: Machine, gpu: bool) -> None:
    if gpu:
        assert machine.gpu_memory_gb is not None
        budget = machine.gpu_memory_gb * GiB
        if out.device_total > budget:
            top = sorted(out.lines, key=lambda line: -line.device)[:3]
            parts = ", ".join(f"{line.part} {line.device / GiB:.1f} GiB" for line in top)
            out.problems.append(f"device memory: {out.device_total / GiB:.1f} GiB per GPU (stage {out.stage}) does not "
                                f"fit {machine.gpu_memory_gb:g} GiB; largest: {parts}")
    host_budget = machine.host_memory_gb * GiB
    if out.node_host_total > host_budget:
        out.problems.append(f"host memory: {out.node_host_total / GiB:.1f} GiB per node does not fit "
                            f"{machine.host_memory_gb:g} GiB")


def fits_within(predicted: float, measured: float, tolerance: float = 0.15) -> bool:
    """|predicted - measured| <= tolerance x measured."""
    return math.isfinite(predicted) and abs(predicted - measured) <= tolerance * measured
