"""The learner's health check before training: the ranks form their world and it is the expected one.

    srun ... python -m megathunder.learner.preflight CONFIG [k=v ...] --expect-world N

Every rank bootstraps from Slurm's environment exactly as ``megathunder train`` does
(``init_distributed``: rendezvous, TP x PP x DP checked against the world, Megatron's groups), then
the ranks all-gather their node names and rank 0 prints one line with the layout. A rank that
cannot start, a layout that does not divide the world, or a world of the wrong size fails here in
seconds, before any rollout or training time is spent.
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megathunder.learner.preflight")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--expect-world", type=int, required=True)
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from megathunder.config import ConfigError, load_config
    from megathunder.learner.parallel import init_distributed

    try:
        pgs = init_distributed(load_config(args.config, args.overrides).learner)
    except ConfigError as err:
        print(f"megathunder preflight: learner: {err}", file=sys.stderr, flush=True)
        return 2
    nodes: list[str | None] = [None] * pgs.world_size
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    if pgs.world_size > 1:
        dist.all_gather_object(nodes, node)
    else:
        nodes = [node]
    if pgs.world_size != args.expect_world:
        print(f"megathunder preflight: learner: world size {pgs.world_size}, expected {args.expect_world}",
              file=sys.stderr, flush=True)
        return 3
    if pgs.rank == 0:
        per_node = ", ".join(f"{n} x{c}" for n, c in collections.Counter(nodes).items())
        d = pgs.dims
        print(f"megathunder preflight: learner world {pgs.world_size} = tp {d.tp} x pp {d.pp} x dp {d.dp} "
              f"on {per_node}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
