"""``learner.cpu_cores`` / ``rollout.engine.cpu_cores`` (``megathunder.cpu_cores``): core lists as
configs write them, the shares of ranks and engine workers, the errors by field, and the learner's
thread pinned where it is told (the engine's workers: ``tests/integration/test_vllm_engine.py::
test_workers_run_on_the_engines_cores``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from megathunder import cpu_cores
from megathunder.config import ConfigError, EngineConfig, load_config
from megathunder.learner.service import LearnerService
from megathunder.rollout.engines.common import cpu_environment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
ALLOWED = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("value, cores", [
    (None, None), (3, [3]), ([1, 0, 1], [0, 1]), ("0-3,6", [0, 1, 2, 3, 6]), ("2", [2]), ("5, 1-2", [1, 2, 5]),
])
def test_core_lists_parse_as_configs_write_them(value, cores):
    assert cpu_cores.parse(value) == cores
    if cores is not None:
        assert cpu_cores.parse(cpu_cores.format_list(cores)) == cores


@pytest.mark.parametrize("value", ["", "a", "1-", "-2", [], [-1], [1.5], True, {"a": 1}])
def test_anything_else_is_refused(value):
    with pytest.raises(ValueError):
        cpu_cores.parse(value)


def test_format_list_writes_runs():
    assert cpu_cores.format_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert cpu_cores.format_list([4]) == "4"


def test_shares_split_the_list_in_order():
    cores = list(range(7))
    assert [cpu_cores.share(cores, i, 3) for i in range(3)] == [[0, 1], [2, 3], [4, 5, 6]]
    assert cpu_cores.share([0, 1], 1, 4) == [0, 1]  # fewer cores than members: they share all
    assert cpu_cores.engine_environment(None) == {}
    assert cpu_cores.engine_environment([0, 1, 2, 3], workers=2) == {cpu_cores.BIND_ENV: "0-1|2-3"}


@pytest.mark.parametrize("env, expected", [
    ({}, (0, 1)),
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, (1, 4)),  # torchrun
    ({"SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "8"}, (3, 8)),  # srun, one task per rank
    ({"SLURM_LOCALID": "3"}, (0, 1)),  # the node's number of ranks unknown: all share all cores
    ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, (0, 1)),  # inconsistent: never an empty share
])
def test_a_ranks_share_comes_from_its_launcher(env, expected):
    assert cpu_cores.local_rank(env) == expected
    assert cpu_cores.share([0, 1, 2, 3, 4, 5, 6, 7], *cpu_cores.local_rank(env))


def test_each_engine_and_each_of_its_workers_binds_its_own_share():
    assert cpu_environment(EngineConfig()) == {}
    assert cpu_environment(EngineConfig(cpu_cores="0-3")) == {cpu_cores.BIND_ENV: "0-3"}
    tp2 = EngineConfig(cpu_cores="0-7", vllm_kwargs={"tensor_parallel_size": 2})
    assert cpu_environment(tp2) == {cpu_cores.BIND_ENV: "0-3|4-7"}
    servers = EngineConfig(deployment="server", num_servers=2, cpu_cores=[4, 5, 6, 7])
    assert [cpu_environment(servers, i) for i in range(2)] == [{cpu_cores.BIND_ENV: "4-5"}, {cpu_cores.BIND_ENV: "6-7"}]


def test_config_errors_name_the_field():
    cfg = load_config(QUICKSTART, ["learner.cpu_cores=1", "rollout.engine.cpu_cores=0"])
    assert (cfg.learner.cpu_cores, cfg.rollout.engine.cpu_cores) == ([1], [0])
    assert load_config(QUICKSTART, ["learner.cpu_cores=2-3"]).learner.cpu_cores == [2, 3]
    with pytest.raises(ConfigError, match=r"learner.cpu_cores: cores \[1\] are also rollout.engine.cpu_cores"):
        load_config(QUICKSTART, ["learner.cpu_cores=0-1", "rollout.engine.cpu_cores=1"])
    with pytest.raises(ConfigError, match="rollout.engine.cpu_cores"):
        load_config(QUICKSTART, ["rollout.engine.cpu_cores=x"])


def test_cores_this_process_may_not_use_are_refused_before_anything_starts(tmp_path):
    missing = max(ALLOWED) + 1
    with pytest.raises(ValueError, match=rf"learner.cpu_cores: cores \[{missing}\] are not available"):
        cpu_cores.check_available("learner.cpu_cores", [ALLOWED[0], missing])
    cpu_cores.check_available("learner.cpu_cores", ALLOWED)
    cpu_cores.check_available("learner.cpu_cores", None)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "megathunder.cli", "train", QUICKSTART, f"run.output_dir={out}",
         f"rollout.engine.cpu_cores={missing}"],
        env={**os.environ, "MEGATHUNDER_SUPERVISE": "0"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"rollout.engine.cpu_cores: cores [{missing}] are not available" in proc.stderr
    assert not out.exists()  # refused before the run directory, the learner or any engine


class Where:
    def cores(self) -> tuple[list[int], int]:
        return sorted(os.sched_getaffinity(0)), torch.get_num_threads()


def _in_thread(fn):
    """``fn()`` on a new thread (its affinity changes stay there)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(timeout=60)
    assert out, "the thread did not finish"
    return out[0]


def test_the_learner_thread_runs_on_the_learners_cores_and_threads():
    threads = torch.get_num_threads()
    core = ALLOWED[-1]

    def pinned():
        service = LearnerService(Where(), cpu_cores=[core])
        try:
            return service.submit(Where.cores).result(timeout=60)
        finally:
            service.stop()

    try:
        assert _in_thread(pinned) == ([core], 1)
    finally:
        torch.set_num_threads(threads)


def test_an_unpinned_learner_keeps_the_cores_it_was_created_on_when_the_controller_moves():
    """The controller pins its own thread to the rollout's cores after it created the service; the
    learner thread, started later from it, must not follow."""

    def moved():
        service = LearnerService(Where())
        try:
            os.sched_setaffinity(0, ALLOWED[:1])  # the controller's thread, now the rollout's
            return service.submit(Where.cores).result(timeout=60)
        finally:
            service.stop()

    cores, _ = _in_thread(moved)
    assert cores == ALLOWED
