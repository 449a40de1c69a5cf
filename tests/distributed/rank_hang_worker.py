"""Two learner ranks under the trainer's LearnerService; rank 1 hangs in its third call, or is slow.

    worker.py MODE HEARTBEAT_TIMEOUT_S CALL_TIMEOUT_S FAULT_FILE

MODE ``sigstop``: rank 1 SIGSTOPs itself (its heartbeat thread stops with it); ``spin``: rank 1
loops forever inside the call (its heartbeat thread lives on); ``slow``: every call of rank 1
sleeps 2.5 beats and the run ends normally; ``hang_learner`` / ``kill_learner``: after call 2,
rank 0 sends rank 1 the chaos fault (``LearnerService.fault``), and rank 1 SIGSTOPs / SIGKILLs
itself as it receives it. Before the fault, the rank that makes it writes the time to FAULT_FILE
(the test measures detection from it). Rank 0 exits 3 if it finds a dead rank
(``LearnerRankLost``). Rank 0 starts a ``multiprocessing`` Manager first and prints its pid
(``CHILD``), as Megatron's checkpoint writer does: the watchdog must not leave it behind. Run by
tests/distributed/test_rank_hang.py.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megathunder.config import ChaosFault  # noqa: E402
from megathunder.learner.liveness import HEARTBEAT_S  # noqa: E402
from megathunder.learner.service import LearnerRankLost, LearnerService  # noqa: E402
from megathunder.trainer.chaos import learner_controls  # noqa: E402

NUM_CALLS = 6


def main() -> int:
    mode, fault_file = sys.argv[1], sys.argv[4]
    heartbeat_timeout_s, call_timeout_s = float(sys.argv[2]), float(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def write_fault_time() -> None:
        with open(fault_file, "w") as f:
            f.write(repr(time.time()))
            f.flush()
            os.fsync(f.fileno())

    def hang() -> None:
        write_fault_time()
        if mode == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        while True:  # spin: the step loop is wedged, the heartbeat thread beats on
            time.sleep(0.05)

    class Endpoint:
        calls = 0

        def step(self, x: int) -> int:
            self.calls += 1
            if rank == 1 and mode == "slow":
                time.sleep(2.5 * HEARTBEAT_S)
            elif rank == 1 and self.calls == 3 and mode in ("sigstop", "spin"):
                hang()
            t = torch.ones(1)
            dist.all_reduce(t)  # a collective, as every learner step has: rank 0 waits in it
            return x

    controls = learner_controls([ChaosFault(kind=mode, rank=1)], rank) if mode in ("hang_learner", "kill_learner") else {}
    service = LearnerService(Endpoint(), rank, dist.get_world_size(), heartbeat_timeout_s=heartbeat_timeout_s,
                             call_timeout_s=call_timeout_s, controls=controls)
    if rank != 0:
        service.serve()
        return 0
    manager = multiprocessing.get_context("fork").Manager()
    print(f"CHILD {manager._process.pid}", flush=True)  # type: ignore[attr-defined]
    try:
        for i in range(NUM_CALLS):
            if i == 2 and mode in ("hang_learner", "kill_learner"):
                write_fault_time()
                service.control("fault", mode, 1)
            service.submit(Endpoint.step, i).result()
            print(f"CALL {i} done", flush=True)
    except LearnerRankLost as err:
        print(f"megathunder: {err}", flush=True)
        manager.shutdown()  # it holds our stdout: the test reads to its end
        os._exit(3)
    service.stop()
    manager.shutdown()
    print("FINISHED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
