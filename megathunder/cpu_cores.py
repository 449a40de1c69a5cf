"""Which CPU cores the learner and the rollout engine run on, when they share one machine.

On a cluster the learner and the vLLM engines have GPUs of their own, and ThunderSyncRL's overlap
bound B = (W + T) / max(W, T) assumes exactly that: the rollout's wait W and the learner's work T
use different resources. On a CPU machine both compute on the same cores unless told otherwise:
vLLM's CPU workers bind their threads to cores of their own choosing (its automatic binding; on
this project's 2-core machine core 0 alone) while torch's threads in the learner use every core,
so the two oversubscribe the cores vLLM took. Measured on the 2-core machine of this project
(`megathunder bench schedules` on the tools workload), one core each did not raise thunder's share
of B on the calculator workload (85-86% vs 88-89% shared, same warm-started model) and made both
schedules slower (the learner's pass on one core). The rollout's slowdown under thunder seen there
(7-8%) came with 2.5-2.8 s a step of learner work in Megatron's unfused attention; with torch's
fused attention (1.6-2.2 s) it is gone on shared cores.

``learner.cpu_cores`` and ``rollout.engine.cpu_cores`` give each side its own cores (disjoint,
checked at parse time; each a subset of the cores this process may use, checked before any
engine starts):

- the learner: every learner rank's compute thread is pinned to its share of the learner's cores
  (the ranks of one node split them in order; fewer cores than ranks: they share all of them),
  and torch's intra-op threads are set to the share's size;
- the rollout: the trainer's own thread (the agent loops, tokenisation, verifiers, vLLM's client)
  is pinned to the rollout's cores before the engine starts, so the engine's processes inherit
  them, and vLLM's CPU workers bind their OpenMP threads to them (``VLLM_CPU_OMP_THREADS_BIND``:
  one share per worker of an engine, the engine's cores split in order).

With both set the engine no longer generates on the learner's cores, so the learner stops holding
its work while sequences generate (``ledger.hold_while_generating``: ``in_process`` applies only
to shared cores). Only where the work runs changes, never what is computed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def parse(value: object) -> list[int] | None:
    """A core list as configs write it -- ``[0, 1]``, ``3``, or taskset's ``"0-3,6"`` -- sorted and
    without repeats; None stays None. Raises ValueError on anything else."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"not a core list: {value!r}")
    if isinstance(value, int):
        items: list[object] = [value]
    elif isinstance(value, str):
        items = []
        for part in value.replace(" ", "").split(","):
            first, sep, last = part.partition("-")
            if not first.isdigit() or (sep and not last.isdigit()):
                raise ValueError(f"not a core list: {value!r} (write e.g. 0-3,6)")
            items.extend(range(int(first), int(last) + 1) if sep else [int(first)])
    elif isinstance(value, Sequence):
        items = list(value)
    else:
        raise ValueError(f"not a core list: {value!r}")
    if not items:
        raise ValueError("an empty core list (null leaves the placement to the OS)")
    cores: set[int] = set()
    for core in items:
        if isinstance(core, bool) or not isinstance(core, int) or core < 0:
            raise ValueError(f"not a core number: {core!r}")
        cores.add(core)
    return sorted(cores)


def check_available(field: str, cores: Sequence[int] | None) -> None:
    """Refuse cores this process may not run on (a container's or Slurm's CPU set), by field."""
    if cores is None:
        return
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cores) - allowed)
    if missing:
        raise ValueError(f"{field}: cores {missing} are not available to this process "
                         f"(it may use {format_list(sorted(allowed))})")


def share(cores: Sequence[int], index: int, count: int) -> list[int]:
    """Member ``index`` of ``count``'s cores: the list split in order into ``count`` equal runs
    (the remainder to the last); all of them when there are fewer cores than members."""
    if len(cores) < count:
        return list(cores)
    size = len(cores) // count
    return list(cores[index * size : (index + 1) * size if index < count - 1 else len(cores)])


def pin_this_thread(cores: Sequence[int] | None, threads: bool = False) -> None:
    """Run the calling thread (and the threads and processes it starts from now on) on ``cores``;
    with ``threads`` also size torch's intra-op threads to them. None: nothing changes."""
    if cores is None:
        return
    os.sched_setaffinity(0, cores)  # Linux: 0 is the calling thread
    if threads:
        import torch

        torch.set_num_threads(len(cores))


def local_rank(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(this learner rank's index among the ranks of its node, their number) from the launcher's
    environment: torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE, or srun's SLURM_LOCALID /
    SLURM_NTASKS_PER_NODE. (0, 1) -- every rank of the node on all the cores -- where the number
    is not known."""
    env = os.environ if env is None else env
    for index, count in (("LOCAL_RANK", "LOCAL_WORLD_SIZE"), ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")):
        if env.get(index, "").isdigit() and env.get(count, "").isdigit() and int(env[index]) < int(env[count]):
            return int(env[index]), int(env[count])
    return 0, 1


def engine_environment(cores: Sequence[int] | None, workers: int = 1) -> dict[str, str]:
    """What an engine's processes need in their environment to bind vLLM's CPU workers (one share
    of ``cores`` each, ``|``-separated as vLLM reads it) -- nothing without cores."""
    if cores is None:
        return {}
    return {BIND_ENV: "|".join(format_list(share(cores, i, workers)) for i in range(workers))}


def format_list(cores: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (what taskset and vLLM read)."""
    runs: list[str] = []
    start = prev = None
    for core in [*cores, None]:
        if core is not None and prev is not None and core == prev + 1:
            prev = core
            continue
        if start is not None:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = core
    return ",".join(runs)
