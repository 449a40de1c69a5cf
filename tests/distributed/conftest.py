"""Multi-process learner tests: each test launches ranks (gloo on CPU), forked from a fork server that imported torch and Megatron once (``forkserver.py``)."""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("learner_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, mode: str, *args: str, timeout: int = 600, worker: Path = WORKER,
           mode_arg: bool = True) -> None:
    """``worker mode args...`` on ``nproc`` ranks (``mode_arg=False``: a worker without modes;
    ``mode`` only names the run in errors): forked from the fork server on CPU (``forkserver.py``:
    the imports done once), by ``torchrun`` on GPUs or with ``MEGATHUNDER_TEST_TORCHRUN=1``."""
    argv = [*([mode] if mode_arg else []), *args]
    if os.environ.get("MEGATHUNDER_TEST_TORCHRUN") == "1" or torch.cuda.is_available():
        _torchrun(nproc, mode, worker, argv, timeout)
        return
    with tempfile.TemporaryDirectory(prefix="mt-launch-") as logs:
        reply = _ForkServer.get().run(dict(worker=str(worker), argv=argv, nproc=nproc, port=free_port(),
                                           timeout=timeout, log_dir=logs))
        if reply["rc"] != 0:
            outs = []
            for rank in range(nproc):
                log = Path(logs) / f"rank{rank}.out"
                text = log.read_text(errors="replace") if log.exists() else ""
                lines = [line for line in text.splitlines() if "Warning" not in line and "warnings.warn" not in line]
                outs.append(f"--- rank {rank}:\n" + "\n".join(lines)[-4000:])
            what = "timed out" if reply["rc"] == 124 else f"failed ({reply['rc']}, rank {reply['rank']})"
            raise AssertionError(f"{mode} with {nproc} ranks {what}: {reply.get('error', '')}\n" + "\n".join(outs))


def _torchrun(nproc: int, mode: str, worker: Path, argv: list[str], timeout: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "--master-addr=127.0.0.1", str(worker), *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        tail = "\n".join(line for line in proc.stderr.splitlines() if "Warning" not in line)[-6000:]
        raise AssertionError(f"{mode} with {nproc} ranks failed ({proc.returncode}):\n{tail}")


class _ForkServer:
    """One ``forkserver.py`` process per test session, started at the first launch."""

    _instance: _ForkServer | None = None

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forkserver.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = self._read(300)
        assert ready.get("ready"), f"the fork server did not start: {ready}"
        atexit.register(self.close)

    @classmethod
    def get(cls) -> _ForkServer:
        if cls._instance is None or cls._instance.proc.poll() is not None:
            cls._instance = cls()
        return cls._instance

    def run(self, job: dict) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._read(job["timeout"] + 60)  # the server enforces the job's timeout itself

    def _read(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise AssertionError(f"the fork server stopped answering (exit {self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def make_hf_checkpoint(path: Path, family: str, tie: bool, seed: int = 0, rope_scaling: dict | None = None) -> Path:
    """A tiny random model of the family, saved by transformers itself (``rope_scaling``: its RoPE
    scaling, as a config.json gives it)."""
    import transformers

    classes = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }
    config_cls, model_cls = classes[family]
    moe: dict = {}
    if family == "qwen3_moe":
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[])
    elif family == "qwen2_moe":  # a sigmoid-gated shared expert beside the routed ones; top-k not renormalised
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                   norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True)
    elif family == "mixtral":  # its intermediate_size (64 below) is each expert's width
        moe = dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    config = config_cls(
        **moe,
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        tie_word_embeddings=tie, rms_norm_eps=1e-6, rope_theta=10000.0,
        **({} if rope_scaling is None else {"rope_scaling": {"rope_theta": 10000.0, **rope_scaling}}),
    )
    torch.manual_seed(seed)
    model = model_cls(config).float()
    if family in ("qwen2", "qwen2_moe"):  # random (not zero) biases, so the bias mapping is exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(std=0.1)
    if family in ("qwen3_moe", "qwen2_moe", "mixtral"):  # routers far from ties, experts distinct (ROUTER_GAP)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(std=1.0)
                layer.mlp.experts.gate_up_proj.normal_(std=0.2)
                layer.mlp.experts.down_proj.normal_(std=0.2)
                if family == "qwen2_moe":  # a shared expert and gate that matter to the output
                    for param in (*layer.mlp.shared_expert.parameters(), layer.mlp.shared_expert_gate.weight):
                        param.normal_(std=0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_qwen2(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2", tie=True)


@pytest.fixture(scope="session")
def hf_qwen3_moe(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE (4 experts, top-2, norm_topk_prob) saved by transformers, one tensor per expert."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf") / "qwen3_moe", "qwen3_moe", tie=False, seed=3)


@pytest.fixture(scope="session")
def hf_qwen2_moe(tmp_path_factory) -> Path:
    """A tiny Qwen2-MoE (4 experts, top-2 of the softmax, a gated shared expert of width 24, q/k/v biases)."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf") / "qwen2_moe", "qwen2_moe", tie=False, seed=5)


@pytest.fixture(scope="session")
def hf_mixtral(tmp_path_factory) -> Path:
    """A tiny Mixtral (4 experts of width 64, top-2) saved by transformers (block_sparse_moe.experts.e.w1/w2/w3)."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf") / "mixtral", "mixtral", tie=False, seed=6)
