"""The benchmarks' ``megathunder train``: the same run with a benchmark's knobs installed around the
product's parts (``megathunder.trainer.run.Extras``), not threaded through them.

    python -m megathunder.bench.bench_train [--paired] [--tool-latency S] [--verifier-latency S] CONFIG [key=value ...]

- ``--paired`` (``schedule.mode=thunder``): the even optimizer steps take sync's path (the whole
  batch, then its gradient) and the odd ones thunder's; each step's metrics row names its path
  (``schedule``). Both give the same update, so the run trains as either would; only the timing
  differs, and here it is measured step against step in one run, where a shared machine's drift
  moves two separate runs apart by more than the difference (``megathunder bench schedules --paired``).
- ``--tool-latency S``: every tool call takes S seconds more (``SlowTools``; a stand-in for a
  sandbox's work, bounded by the episode's wall time as the call is);
- ``--verifier-latency S``: every reward comes S seconds later (``SlowVerifier``; a stand-in for a
  test suite, outside the verifier pool's concurrency and timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial

from megathunder import console
from megathunder.config import ConfigError, VerifierConfig, load_config
from megathunder.rollout.sandbox import Sandbox
from megathunder.rollout.verifiers import RewardOutcome, Verdict, VerifierPool
from megathunder.trainer import interrupt
from megathunder.trainer.run import Extras, train_command
from megathunder.trainer.schedules import Steps, run_steps, sync_step, thunder_step
from megathunder.trainer.trainer import Pending, Trainer


async def run_paired(tr: Trainer, steps: Steps) -> None:
    """Thunder with sync's path at even steps (module docstring)."""

    async def paired_step(tr: Trainer, step: int, last: Pending) -> Pending:
        if step % 2 == 0:
            return await sync_step(tr, step, last, label="sync")
        return await thunder_step(tr, step, last)

    await run_steps(tr, steps, paired_step)


class SlowVerifier:
    """A verifier pool whose every score comes ``seconds`` later (the sleep outside the pool)."""

    def __init__(self, pool: VerifierPool, seconds: float) -> None:
        self.pool, self.seconds = pool, seconds

    async def score(self, verify: Callable[[], Awaitable[float | Verdict]], *, traj_id: int,
                    timeout_s: float | None = None) -> RewardOutcome:
        await asyncio.sleep(self.seconds)
        return await self.pool.score(verify, traj_id=traj_id, timeout_s=timeout_s)

    @property
    def cfg(self) -> VerifierConfig:
        return self.pool.cfg

    def failed(self, traj_id: int, detail: str) -> RewardOutcome:
        return self.pool.failed(traj_id, detail)


async def _slow_run(run: Callable[[Sandbox | None, Mapping[str, str]], Awaitable[str]], seconds: float,
                    sandbox: Sandbox | None, args: Mapping[str, str]) -> str:
    await asyncio.sleep(seconds)
    return await run(sandbox, args)


def slow_parts(tool_s: float, verifier_s: float) -> Callable[[Trainer], None]:
    """Installs ``SlowTools`` (each tool's run ``tool_s`` seconds longer) and ``SlowVerifier``."""

    def install(tr: Trainer) -> None:
        loop = tr.agent_loop
        if tool_s:
            loop.tools = {name: dataclasses.replace(tool, run=partial(_slow_run, tool.run, tool_s))
                          for name, tool in loop.tools.items()}
        if verifier_s:
            loop.verifiers = SlowVerifier(loop.verifiers, verifier_s)  # type: ignore[assignment]

    return install


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megathunder.bench.bench_train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paired", action="store_true", help="thunder with sync's path at even steps")
    parser.add_argument("--tool-latency", type=float, default=0.0, help="seconds added to every tool call")
    parser.add_argument("--verifier-latency", type=float, default=0.0, help="seconds added before every reward")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if not console.verbose():
        console.quiet_third_party()
    if args.tool_latency < 0 or args.verifier_latency < 0:
        parser.error("latencies must be >= 0")
    try:
        cfg = load_config(args.config, args.overrides, paths=True)
        if args.paired and cfg.schedule.mode != "thunder":
            raise ConfigError(f"schedule.mode: --paired alternates thunder's steps with sync's; needs thunder "
                              f"(not {cfg.schedule.mode})")
    except ConfigError as err:
        print(f"megathunder: {err}", file=sys.stderr)
        return 2
    if interrupt.should_supervise():  # an interactive run: Ctrl-C stops it after the step, as train's
        return interrupt.supervise(list(sys.argv[1:] if argv is None else argv), module="megathunder.bench.bench_train")
    interrupt.as_supervised_child()
    extras = Extras(schedule=run_paired if args.paired else None,
                    install=slow_parts(args.tool_latency, args.verifier_latency))
    return train_command(cfg, extras)


if __name__ == "__main__":
    sys.exit(main())
