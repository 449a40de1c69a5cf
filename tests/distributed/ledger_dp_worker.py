"""Two data-parallel ledgers on the torch backend (gloo): each owns every other trajectory, counts
the others' loss tokens as ``on_remote_finished`` is told, and the summed update is checked against
the batch reference. ``wrong``: rank 1 is told a wrong count for one of rank 0's trajectories (the
mask's sum where the objective's overlong filter counts 0): both ranks must refuse the batch at
close, naming the counts, instead of dividing by a wrong Z."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megathunder.config import GRPOObjective, LedgerConfig  # noqa: E402
from megathunder.objectives import num_loss_tokens  # noqa: E402
from megathunder.streaming import GradientLedger, LedgerError, TorchBackend  # noqa: E402
from megathunder.streaming.reference import reference_gradient  # noqa: E402
from megathunder.trajectory import batch_plan  # noqa: E402
from tests.helpers import make_case, rel_err, small_model  # noqa: E402


def main(mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    objective = GRPOObjective(loss_agg="token_mean", overlong_filter=True)
    _, batch, rewards = make_case(7, torch.float64, "continuous")
    batch[0].truncated = True  # the overlong filter: 0 loss tokens, while its mask is not empty
    model = small_model("float64")
    backend = TorchBackend(model, objective)
    ledger = GradientLedger(backend, objective, LedgerConfig(), dp_group=dist.group.WORLD)
    ledger.begin_batch(batch_plan(batch))
    for t in batch:
        if t.traj_id % 2 == rank:
            ledger.on_finished(t)
        else:
            n = num_loss_tokens(t, objective)
            if mode == "wrong" and rank == 1 and t.traj_id == 0:
                n = int(t.loss_mask.sum())
            ledger.on_remote_finished(t.traj_id, n)
    for t in batch:
        ledger.on_reward(t.traj_id, rewards[t.traj_id])
    if mode == "wrong":
        try:
            ledger.close_batch()
        except LedgerError as err:
            assert "loss-token counts disagree" in str(err), err
            print("REFUSED", err, flush=True)
            return
        raise AssertionError(f"rank {rank}: a wrong remote count closed the batch")
    ledger.close_batch()
    grad = backend.live.flat().clone()
    dist.all_reduce(grad)  # the data-parallel reduce of the step
    ref = reference_gradient(small_model("float64"), batch, rewards, objective)
    assert rel_err(grad, ref) <= 1e-10, rel_err(grad, ref)


if __name__ == "__main__":
    main(sys.argv[1])
