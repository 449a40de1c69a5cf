"""Host tuning: where a run's threads compute and what the garbage collector scans, in one object.

None of it changes what is computed, only where and when; each item was measured on the project's
2-core CPU machine (BENCHMARKS.md) and does nothing where it does not apply:

- cores (``megathunder.cpu_cores``): ``learner.cpu_cores`` / ``rollout.engine.cpu_cores`` give the
  learner ranks and the rollout their own cores (each rank of a node its share);
- the start-up heap (``freeze_startup_heap``): every object alive once a process has started
  (torch, Megatron, vLLM's client: ~0.8M objects) is frozen out of the collector's sight, whose full
  collections otherwise stall the learner thread and the rollout alike for 0.3-0.6 s;
- rank 0's controller thread runs with ``cpu_compat`` suspended (its CUDA-to-CPU mapping stays on
  the learner thread: the controller's torch calls, 160 a step on the quickstart, skip it);
- the generation hold (``ledger.hold_while_generating``): an in-process engine generating on the
  learner's own cores keeps an event's pack window open (``LearnerService``'s ``PackWindow``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from megathunder import cpu_cores
from megathunder.config import Config, ConfigError
from megathunder.learner import cpu_compat


class HostTuning:
    """The host tuning of one process of a run (module docstring). Its cores are checked against
    the machine when built (a config may be written elsewhere): a ``ConfigError`` naming the field."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        learner, rollout = cfg.learner.cpu_cores, cfg.rollout.engine.cpu_cores
        try:
            cpu_cores.check_available("learner.cpu_cores", learner)
            cpu_cores.check_available("rollout.engine.cpu_cores", rollout)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self.learner_cores = None if learner is None else cpu_cores.share(learner, *cpu_cores.local_rank())
        """This rank's share of the learner's cores (None: unpinned)."""
        self.rollout_cores = rollout

    @contextmanager
    def follower(self) -> Iterator[None]:
        """A learner rank > 0 serving rank 0's calls on its main thread."""
        cpu_cores.pin_this_thread(self.learner_cores, threads=True)
        freeze_startup_heap()
        try:
            yield
        finally:
            gc.unfreeze()

    @contextmanager
    def controller(self) -> Iterator[None]:
        """Rank 0's controller (its learner calls run on the service's own thread)."""
        try:
            with cpu_compat.suspended():
                yield
        finally:
            gc.unfreeze()  # the interpreter's last collection then frees the frozen cycles

    def pin_rollout(self) -> None:
        """The controller's thread onto the rollout's cores, before the engine starts: its processes
        inherit them."""
        cpu_cores.pin_this_thread(self.rollout_cores)

    def generation_hold(self, generating: Callable[[], bool] | None) -> Callable[[], bool] | None:
        """What keeps the learner's pack window open while the rollout generates on its cores:
        ``generating`` (an in-process engine's) unless the learner and the rollout have cores of
        their own or ``ledger.hold_while_generating`` is never."""
        own_cores = self.learner_cores is not None and self.rollout_cores is not None  # disjoint
        if generating is None or own_cores or self.cfg.ledger.hold_while_generating != "in_process":
            return None
        return generating


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (torch, Megatron, vLLM's client, transformers: ~0.8M
    objects on the quickstart) out of the garbage collector's sight. Its full collections scan
    them all, 0.3-0.6 s with the GIL held, which stalls the learner thread and the rollout alike:
    on the quickstart one such pause in a 6-step run made a 0.35 s step 0.9 s (BENCHMARKS.md).
    Frozen objects are still freed by reference counting; only cycles among them are not -- until
    ``gc.unfreeze()`` at the run's end, without which triton's bindings (installed with vLLM, imported
    by torch's dynamo) print "nanobind: leaked ..." for their cycles as the interpreter exits."""
    gc.collect()
    gc.freeze()
