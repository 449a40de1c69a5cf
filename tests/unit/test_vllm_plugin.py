"""megathunder's vLLM general plugin: the shared-memory spin cap, only where megathunder asks."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
from pydantic import ValidationError

from megathunder.config import EngineConfig
from megathunder.rollout.engines import vllm_plugin

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
zmq = pytest.importorskip("zmq")


@pytest.fixture
def spin_condition(monkeypatch):
    """vLLM's SpinCondition, restored after the test (the plugin patches the class), with no cap in
    force (an in-process engine started earlier in this process may have loaded the plugin)."""
    cls = shm_broadcast.SpinCondition
    monkeypatch.setattr(cls, "__init__", cls.__init__)
    monkeypatch.setattr(cls, "megathunder_spin_s", None, raising=False)
    monkeypatch.delenv(vllm_plugin.SPIN_ENV, raising=False)
    context = zmq.Context()
    made = []

    def make(is_reader: bool):
        c = cls(is_reader=is_reader, context=context, notify_address=f"ipc:///tmp/mt-spin-{id(made)}-{len(made)}")
        made.append(c)
        return c

    yield make
    context.destroy(linger=0)


def test_the_plugin_is_an_entry_point_vllm_loads():
    [ep] = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "megathunder_shm_spin"]
    assert ep.load() is vllm_plugin.register


def test_without_megathunders_environment_vllm_keeps_its_own_spin(spin_condition):
    vllm_plugin.register()
    assert vllm_plugin.spin_cap() is None
    assert spin_condition(is_reader=True).busy_loop_s == 1


def test_an_engine_started_by_megathunder_caps_every_reader(spin_condition, monkeypatch):
    cfg = EngineConfig(shm_spin_s=0.015)
    for name, value in vllm_plugin.environment(cfg).items():
        monkeypatch.setenv(name, value)
    vllm_plugin.register()
    vllm_plugin.register()  # loaded twice (vLLM loads plugins once per process; harmless anyway)
    assert vllm_plugin.spin_cap() == 0.015
    assert spin_condition(is_reader=True).busy_loop_s == 0.015
    assert spin_condition(is_reader=False).busy_loop_s == 0  # writers never spin


def test_a_spin_cap_of_zero_is_refused(spin_condition):
    with pytest.raises(ValueError, match="MEGATHUNDER_VLLM_SHM_SPIN_S"):
        vllm_plugin.cap_shm_spin(0.0)
    with pytest.raises(ValidationError, match="shm_spin_s"):
        EngineConfig(shm_spin_s=0)
