"""megathunder's vLLM general plugin: how long vLLM's shared-memory readers spin, and routing
capture bound at model load.

vLLM's engine core hands each step's scheduler output to its worker processes (and reads their
results back) through a shared-memory ring buffer (``vllm.distributed.device_communicators.
shm_broadcast``). A reader that finds the next block unwritten busy-polls it -- ``sched_yield`` in
a loop -- for ``SpinCondition.busy_loop_s`` (1 s in vLLM 0.32, not configurable) after its last
read, and only then sleeps on a zmq notification. While rollouts decode, reads come every few
milliseconds, so the worker never sleeps: on a machine where the learner and vLLM share a few
cores, that spin takes one of them (measured on the 2-core quickstart, alternated runs: the
worker's mean CPU 0.83 of a core, the learner's pass after generation 0.43 s and sync's step
0.90 s; with a 0.02 s spin 0.45, 0.33 s and 0.82 s; BENCHMARKS.md).

``rollout.engine.shm_spin_s`` caps the spin. vLLM loads general plugins (entry point group
``vllm.general_plugins``, ``pyproject.toml``) in every process it starts -- engine core, workers,
API servers -- before they build their message queues; this one acts only when megathunder's
engine set ``MEGATHUNDER_VLLM_SHM_SPIN_S`` in their environment (``environment``), so other users
of the same vLLM install are untouched. A reader past the cap waits on the writer's zmq
notification, which the writer sends after every write: what it reads is unchanged, only how it
waits.

Routing capture (``rollout.engine.record_routing``, ``MEGATHUNDER_VLLM_RECORD_ROUTING``): the
recorder's hooks must be on the routers before vLLM compiles the model and captures its CUDA
graphs, or the graphs replay forwards that never call them. vLLM calls a worker's ``load_model``
before either (``compile_or_warm_up_model`` comes after), so the recorder is bound right after it
(``routing_capture.install_on_runner``); the worker extension's ``megathunder_routing_start`` later
finds it there.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megathunder.config import EngineConfig

SPIN_ENV = "MEGATHUNDER_VLLM_SHM_SPIN_S"
ROUTING_ENV = "MEGATHUNDER_VLLM_RECORD_ROUTING"


def environment(cfg: EngineConfig) -> dict[str, str]:
    """What the processes of an engine with ``cfg`` need in their environment for this plugin
    (every key, set or empty: an in-process engine's environment outlives it)."""
    return {SPIN_ENV: repr(cfg.shm_spin_s), ROUTING_ENV: "1" if cfg.record_routing else ""}


def register() -> None:
    """vLLM's entry point: cap the shared-memory spin, bind routing capture at model load -- each
    only if megathunder asked for it (else nothing)."""
    value = os.environ.get(SPIN_ENV)
    if value:
        cap_shm_spin(float(value))
    if os.environ.get(ROUTING_ENV):
        record_routing_at_load()


def record_routing_at_load() -> None:
    """Bind the routing recorder to every worker's runner as soon as its model is loaded (module
    docstring); once per process."""
    from vllm.v1.worker.gpu_worker import Worker

    if getattr(Worker, "megathunder_records_routing", False):
        return
    load = Worker.load_model

    @functools.wraps(load)
    def load_then_record(self: Any, *args: Any, **kwargs: Any) -> None:
        load(self, *args, **kwargs)
        from megathunder.rollout.engines.routing_capture import install_on_runner

        install_on_runner(self.model_runner)

    Worker.load_model = load_then_record
    Worker.megathunder_records_routing = True


def cap_shm_spin(seconds: float) -> None:
    """Make every shared-memory reader built from now on in this process spin at most ``seconds``."""
    if not seconds > 0:  # 0 sleeps on zmq before every read: measured 8x slower steps
        raise ValueError(f"{SPIN_ENV}: the spin cap must be > 0 seconds, not {seconds}")
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    if getattr(SpinCondition, "megathunder_spin_s", None) is None:
        init = SpinCondition.__init__

        @functools.wraps(init)
        def capped_init(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            cap = SpinCondition.megathunder_spin_s  # None again: vLLM's own spin
            if self.is_reader and cap is not None:
                self.busy_loop_s = min(self.busy_loop_s, cap)

        SpinCondition.__init__ = capped_init
    SpinCondition.megathunder_spin_s = seconds


def spin_cap() -> float | None:
    """The cap in force in this process (None: vLLM's own spin); workers answer it over RPC."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    return getattr(SpinCondition, "megathunder_spin_s", None)
