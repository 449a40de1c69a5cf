"""Engine parts that need no running engine: config, server command line, balancer, weight payloads."""

from __future__ import annotations

import base64

import pytest
import torch

from megathunder.config import ConfigError, load_config
from megathunder.config import EngineConfig
from megathunder.rollout.engines.balancer import LeastOutstandingBalancer
from megathunder.rollout.engines.server import server_command
from megathunder.rollout.engines.rpc import encode_tensors, weight_load_call


def test_engine_config_defaults_and_overrides(tmp_path):
    cfg = EngineConfig()
    assert cfg.deployment == "in_process" and cfg.host == "127.0.0.1"
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  engine:\n    deployment: server\n")
    loaded = load_config(path, ["rollout.engine.num_servers=3", "rollout.engine.dtype=float32"])
    assert loaded.rollout.engine.num_servers == 3 and loaded.rollout.engine.dtype == "float32"


@pytest.mark.parametrize(
    "override, field",
    [
        ("rollout.engine.deployment=ray", "deployment"),
        ("rollout.engine.num_servers=0", "num_servers"),
        ("rollout.engine.gpu_memory_utilization=1.5", "gpu_memory_utilization"),
        ("rollout.engine.server_urls=[http://10.0.0.1:8000]", "server_urls"),  # needs server
        ("rollout.engine.colour=red", "colour"),
        ("rollout.engine.block_size=0", "block_size"),
        ("rollout.engine.block_size=24", "block_size"),  # not a multiple of 16
    ],
)
def test_engine_config_rejects_bad_values(tmp_path, override, field):
    path = tmp_path / "c.yaml"
    path.write_text("{}\n")
    with pytest.raises(ConfigError, match=field):
        load_config(path, [override])


def test_server_command_binds_loopback_and_maps_fields():
    cfg = EngineConfig(
        deployment="server",
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        kv_cache_memory_bytes=2**28,
        enable_prefix_caching=False,
        block_size=32,
        vllm_kwargs={"max_num_seqs": 64},
    )
    cmd = server_command("/m", cfg, port=8123)
    joined = " ".join(cmd)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--host 127.0.0.1 --port 8123" in joined
    assert "--dtype float32" in joined and "--max-model-len 512" in joined
    assert "--enforce-eager" in joined and "--kv-cache-memory-bytes 268435456" in joined
    assert "--no-enable-prefix-caching" in joined and "--max-num-seqs 64" in joined
    assert "--block-size 32" in joined
    assert "--block-size" not in " ".join(server_command("/m", EngineConfig(deployment="server"), port=8123))  # vLLM's
    assert "--worker-extension-cls megathunder.rollout.engines.worker_extension.MegathunderWorkerExtension" in joined
    assert "--enable-scale-out" in cmd  # the tokens-in/tokens-out endpoint


def test_balancer_routes_to_least_outstanding():
    b = LeastOutstandingBalancer(3)
    first = [b.acquire() for _ in range(3)]
    assert sorted(first) == [0, 1, 2]  # idle pool: spread round-robin
    b.release(1)
    assert b.acquire() == 1  # the only server with a free slot
    b.release(0)
    b.release(2)
    assert b.outstanding == [0, 1, 0]
    assert b.acquire() in (0, 2) and b.acquire() in (0, 2)
    with pytest.raises(RuntimeError):
        LeastOutstandingBalancer(1).release(0)


def test_balancer_under_long_tail():
    """One server stuck with a long request gets no new ones while others are less loaded."""
    b = LeastOutstandingBalancer(2)
    stuck = b.acquire()
    for _ in range(10):
        with b.route() as s:
            assert s != stuck
    assert b.outstanding[stuck] == 1 and b.num_routed[stuck] == 1


def test_weight_payload_roundtrip_and_errors(tmp_path):
    from safetensors.torch import load

    tensors = {"a.weight": torch.randn(3, 4), "b.bias": torch.arange(5, dtype=torch.bfloat16)}
    call = weight_load_call(iter(tensors.items()))
    assert call.method == "megathunder_load_safetensors" and call.kwargs is None
    back = load(base64.b64decode(call.args[0]))
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())

    with pytest.raises(FileNotFoundError, match="safetensors"):
        weight_load_call(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(base64.b64decode(encode_tensors(tensors.items())))
    call = weight_load_call(tmp_path)
    assert call.method == "megathunder_load_path" and call.args == (str(tmp_path.resolve()),)
    with pytest.raises(ValueError):
        encode_tensors([])


def test_balancer_session_affinity_is_bounded():
    """A session stays on its server while that server is at most max_imbalance requests busier
    than the least loaded one, then moves, and stays where it moved."""
    b = LeastOutstandingBalancer(2, max_imbalance=2)
    servers = [b.acquire(session="traj-7") for _ in range(5)]
    home = servers[0]
    assert servers == [home, home, home, 1 - home, 1 - home]
    assert b.outstanding[home] == 3 and b.acquire() == 1 - home  # unkeyed requests: least loaded


def test_balancer_forgets_old_sessions():
    b = LeastOutstandingBalancer(2, max_sessions=3)
    for k in range(5):
        b.release(b.acquire(session=k))
    assert list(b._sessions) == [2, 3, 4]


def test_policy_version_read_from_vllm_spans():
    from vllm.outputs import WeightVersionSpan

    from megathunder.rollout.engines.common import single_version

    assert single_version([WeightVersionSpan(version="3", start=0, end=5)], 5, "r") == 3
    assert single_version([{"version": "4", "start": 0, "end": 2}], 2, "r") == 4  # server JSON
    assert single_version(None, 0, "r") == -1  # aborted before its first token
    with pytest.raises(RuntimeError, match="several"):
        single_version([{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 4}], 4, "r")
    with pytest.raises(RuntimeError, match="no weight version"):
        single_version([], 3, "r")


def test_batch_invariant_kernels_reach_every_engine_process_when_asked():
    """``rollout.engine.batch_invariant``: vLLM reads ``VLLM_BATCH_INVARIANT`` as its processes start
    (in-process engines and launched servers alike); off by default."""
    from megathunder.config import EngineConfig, load_config
    from megathunder.rollout.engines.common import engine_environment
    from megathunder.rollout.serve import serve_env

    assert "VLLM_BATCH_INVARIANT" not in engine_environment(EngineConfig())
    assert engine_environment(EngineConfig(batch_invariant=True))["VLLM_BATCH_INVARIANT"] == "1"
    cfg = load_config(None, ["rollout.engine.batch_invariant=true"])
    assert serve_env(cfg, "127.0.0.1")["VLLM_BATCH_INVARIANT"] == "1"
