"""``megathunder plan CONFIG [key=value ...]``: a layout's memory per GPU and per node, and its
traffic, before anything starts (the formulas: ``megathunder.plan.memory_plan``).

    megathunder plan launch/slurm/grpo_128gpu.yaml --world 96
    megathunder plan configs/quickstart.yaml --cpu

The model's sizes come from ``learner.model.hf_checkpoint`` (a Hugging Face directory or its
``config.json``; only that file is read), else from ``run.init_model`` (a directory), else from the
locally built tiny model (``run.tiny_model``) -- or, with ``--sizes config``, from ``learner.model``
itself; the teacher's likewise from ``objective.teacher.hf_checkpoint``. With ``sandbox.backend: remote``
it also counts the sandbox servers' CPUs and memory per node (``--sandbox-*``; ``sandbox_plan.py``).
Prints a table and, as the last line, one JSON object. Exit
status 0 when the layout fits, 1 when it does not (stderr names the part: the field that does not
divide, or the memory that does not fit), 2 for a bad config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from megathunder.config import (
    Config,
    ConfigError,
    DistillObjective,
    PolicyModelConfig,
    TinyModelConfig,
    load_config,
)
from megathunder.plan.memory_plan import GiB, Machine, ModelShape, Plan, plan, read_model_config
from megathunder.plan.sandbox_plan import SandboxNodes, plan_sandboxes

TINY_VOCAB = 512  # the local tokenizer's vocabulary (megathunder.models.tiny_hf), a multiple of 64


def model_shape(cfg: Config, sizes: str = "run") -> ModelShape:
    """The policy's shape. ``sizes="run"``: the model ``megathunder train`` starts from -- its
    config.json (``learner.model.hf_checkpoint``, else ``run.init_model``), else the tiny model.
    ``sizes="config"``: ``learner.model``'s own sizes (a learner built without a checkpoint)."""
    m = cfg.learner.model
    if sizes == "config" and m.hf_checkpoint is None:
        return ModelShape.of(m)
    if m.hf_checkpoint is not None:
        return ModelShape.of(read_model_config(m.hf_checkpoint, m, "learner.model.hf_checkpoint"))
    if cfg.run.init_model != "tiny":
        return ModelShape.of(read_model_config(cfg.run.init_model, m, "run.init_model"))
    return _tiny(cfg.run.tiny_model)


def teacher_shape(cfg: Config) -> ModelShape | None:
    obj = cfg.objective
    if not isinstance(obj, DistillObjective):
        return None
    if obj.teacher.hf_checkpoint is not None:
        base = cfg.learner.model
        return ModelShape.of(read_model_config(obj.teacher.hf_checkpoint, base, "objective.teacher.hf_checkpoint"))
    return _tiny(TinyModelConfig())  # the run builds the quickstart's tiny model as the teacher


def _tiny(t: TinyModelConfig) -> ModelShape:
    moe = {} if not t.num_experts else dict(
        family="qwen3_moe", num_experts=t.num_experts, moe_router_topk=t.num_experts_per_tok,
        moe_ffn_hidden_size=t.moe_intermediate_size)
    dense = dict(family="qwen2", vocab_size=TINY_VOCAB, hidden_size=t.hidden_size, ffn_hidden_size=t.intermediate_size,
                 num_layers=t.num_layers, num_attention_heads=t.num_heads, num_query_groups=t.num_kv_heads,
                 tie_word_embeddings=False)
    return ModelShape.of(PolicyModelConfig.model_validate({**dense, **moe}))  # a MoE's family replaces qwen2


def host_memory_gb() -> float:
    """This machine's memory (``MemTotal``), in GiB."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def render(p: Plan, machine: Machine) -> str:
    rows = [f"layout: world {p.layout['world']} = tp {p.layout['tp']} x pp {p.layout['pp']} x cp {p.layout['cp']} "
            f"x dp {p.layout['dp']}{' (sequence parallel)' if p.layout['sp'] else ''}; "
            f"{_count(p.layout['params'])} parameters; most loaded stage {p.stage}"]
    if p.lines:
        where = f"GPU ({machine.gpu_memory_gb:g} GiB)" if machine.gpu_memory_gb is not None else "process (CPU)"
        rows.append(f"\n{'per rank':<18} {where:>18} {'host':>10}  note")
        for line in p.lines:
            rows.append(f"{line.part:<18} {_gib(line.device):>18} {_gib(line.host):>10}  {line.note}")
        rows.append(f"{'total':<18} {_gib(p.device_total):>18} {_gib(p.host_rank_total):>10}")
        rows.append(f"\n{'per node (host)':<18} {'':>18} {'':>10}")
        for line in p.node_host:
            rows.append(f"{line.part:<18} {'':>18} {_gib(line.host):>10}  {line.note}")
        rows.append(f"{'total':<18} {'':>18} {_gib(p.node_host_total):>10}  of {machine.host_memory_gb:.0f} GiB")
        if p.rollout:
            rows.append(f"\n{'rollout engine':<18} {'GPU':>18}")
            for line in p.rollout:
                rows.append(f"{line.part:<18} {_gib(line.device):>18} {'':>10}  {line.note}")
        rows.append("\nlinks (bytes)")
        for name, value in p.links.items():
            rows.append(f"  {name:<32} {value:,.0f}" if "trajectories" in name else f"  {name:<32} {_gib(value)} GiB")
    rows.append("\n" + ("fits" if p.feasible else "DOES NOT FIT: " + "; ".join(p.problems)))
    return "\n".join(rows)


def _gib(b: float) -> str:
    return f"{b / GiB:.2f}" if b else "-"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def run_plan(cfg: Config, machine: Machine, sizes: str = "run") -> Plan:
    return plan(cfg, model_shape(cfg, sizes), machine, teacher_shape(cfg))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--world", type=int, default=None, help="learner ranks (default: the config's layout)")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU (default 80: H100)")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks: every rank's memory is the node's")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="learner ranks per node (default 8)")
    parser.add_argument("--host-memory-gb", type=float, default=None, help="per node (default: this machine's)")
    parser.add_argument("--sizes", choices=["run", "config"], default="run",
                        help="run: the model megathunder train starts from (hf_checkpoint, init_model or the tiny "
                        "model); config: learner.model's own sizes")
    parser.add_argument("--process-host-gb", type=float, default=None,
                        help="host memory of one learner process besides what is counted (default: an estimate "
                        "on GPUs, 0 on CPU)")
    parser.add_argument("--sandbox-nodes", type=int, default=None,
                        help="nodes running a sandbox server (sandbox.backend: remote; default: its server_urls)")
    parser.add_argument("--sandbox-node-cpus", type=int, default=None,
                        help="CPUs of a sandbox server's node (default: this machine's)")
    parser.add_argument("--sandbox-node-memory-gb", type=float, default=None,
                        help="memory of a sandbox server's node (default: --host-memory-gb)")
    parser.add_argument("--sandbox-reserved-cpus", type=int, default=0,
                        help="CPUs of that node taken by what runs beside the server (a rollout node's vLLM)")
    parser.add_argument("--sandbox-reserved-memory-gb", type=float, default=0.0,
                        help="memory of that node taken by what runs beside the server")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
        machine = Machine(gpu_memory_gb=None if args.cpu else args.gpu_memory_gb, ranks_per_node=args.ranks_per_node,
                          host_memory_gb=args.host_memory_gb if args.host_memory_gb is not None else host_memory_gb(),
                          world=args.world, process_host_gb=args.process_host_gb)
        result = run_plan(cfg, machine, args.sizes)
    except ConfigError as err:
        print(f"megathunder plan: {err}", file=sys.stderr)
        return 2
    servers = getattr(cfg.sandbox, "server_urls", [])
    num_nodes = args.sandbox_nodes if args.sandbox_nodes is not None else len(servers)
    sandboxes = None if num_nodes == 0 else plan_sandboxes(cfg, SandboxNodes(
        num_nodes=num_nodes,
        cpus=args.sandbox_node_cpus if args.sandbox_node_cpus is not None else os.cpu_count() or 1,
        memory_gb=args.sandbox_node_memory_gb if args.sandbox_node_memory_gb is not None else machine.host_memory_gb,
        reserved_cpus=args.sandbox_reserved_cpus, reserved_memory_gb=args.sandbox_reserved_memory_gb))
    if sandboxes is not None:
        result.problems += sandboxes.problems
    print(render(result, machine) + ("" if sandboxes is None else "\n" + "\n".join(sandboxes.lines())))
    out = result.to_json()
    if sandboxes is not None:
        out["sandbox"] = sandboxes.to_json()
    print(json.dumps({"plan": out}), flush=True)
    if not result.feasible:
        for problem in result.problems:
            print(f"megathunder plan: INFEASIBLE: {problem}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megathunder plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
