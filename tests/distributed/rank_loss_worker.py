"""Two learner ranks under the trainer's LearnerService; rank 1 dies during its third call.

Rank 0 must stop within a bounded time with a message naming rank 1. Run by
tests/distributed/test_rank_loss.py under torchrun.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megathunder.learner.service import LearnerRankLost, LearnerService  # noqa: E402


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    class Endpoint:
        calls = 0

        def step(self, x: int) -> int:
            self.calls += 1
            if rank == 1 and self.calls == 3:
                os._exit(9)  # the learner rank dies mid-run
            t = torch.ones(1)
            dist.all_reduce(t)  # a collective, as every learner step has
            return x

    service = LearnerService(Endpoint(), rank, dist.get_world_size())
    if rank != 0:
        service.serve()
        return 0
    start = time.monotonic()
    try:
        for i in range(100):
            service.submit(Endpoint.step, i).result()
            time.sleep(0.1)
    except LearnerRankLost as err:
        print(f"STOPPED after {time.monotonic() - start:.1f} s: {err}", flush=True)
        os._exit(3)
    print("NOT STOPPED", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
