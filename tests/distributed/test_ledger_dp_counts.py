"""Z under data parallelism: every rank's ledger counts every trajectory's loss tokens, the others'
as ``on_remote_finished`` is told; a wrong count there (the mask's sum where the objective's overlong
filter trains nothing) made one rank divide by a wrong Z -- relative error 0.316, silently. The
ledgers cross-check Z at close (``GradientLedger._check_counts``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.conftest import launch

WORKER = Path(__file__).with_name("ledger_dp_worker.py")


@pytest.mark.parametrize("mode", ["right", "wrong"])
def test_the_data_parallel_ledgers_cross_check_their_loss_token_counts(mode):
    launch(2, mode, worker=WORKER, timeout=300)
