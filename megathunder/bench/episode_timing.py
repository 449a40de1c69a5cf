"""``megathunder bench episodes``: where an agentic episode's time goes, and when trajectories
finish, for the bundled tasks.

Generation comes from the scripted test policy (fixed, correct turns through a real tokenizer;
not a model), which simulates decode time at ``--seconds-per-token`` per generated token; tools
run for real in the local sandbox and rewards come from the tasks' real verifiers. Per task it
reports each episode's split into generation / tool / verifier / other (template, parsing, event
emission, sandbox setup and teardown) time, and the distribution of trajectory completion times
and reward arrival times from the start of the batch (what the schedule comparisons consume).
It also measures the sandbox's own cost per command (``true``) for each isolation available.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import time

from pydantic import TypeAdapter

from megathunder.config import AgentLoopConfig, LocalSandboxConfig, TaskConfig, VerifierConfig

TASKS = ("arithmetic", "calculator", "swe_local", "terminal")


def _quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"p10": pick(0.1), "p50": pick(0.5), "p90": pick(0.9), "max": xs[-1]}


async def _run_task(name: str, args, sandbox_cfg: LocalSandboxConfig) -> dict:
    from megathunder.models.local_tokenizer import train_local_chatml_tokenizer
    from megathunder.rollout.agent_loop import AgentLoop
    from megathunder.rollout.chat import ChatMLCodec
    from megathunder.rollout.episode import RolloutEvent
    from megathunder.rollout.scripted import ScriptedPolicy
    from megathunder.rollout.tasks import build_task
    from megathunder.rollout.verifiers import VerifierPool

    codec = ChatMLCodec(train_local_chatml_tokenizer())
    task = build_task(TypeAdapter(TaskConfig).validate_python({"name": name}))
    insts = task.instances(args.num_instances, seed=args.seed)
    policy = ScriptedPolicy(
        codec,
        {i.prompt: task.scripted_turns(i) for i in insts},
        seconds_per_token=args.seconds_per_token,
    )
    events: list[RolloutEvent] = []
    agent_cfg = AgentLoopConfig(
        max_total_tokens=8192,
        max_new_tokens_per_turn=1024,
        max_concurrent_episodes=args.concurrency,
    )
    loop = AgentLoop(
        policy,
        codec,
        task,
        agent_cfg,
        sandbox_cfg,
        VerifierPool(VerifierConfig(max_concurrent=4)),
        emit=events.append,
    )
    t0 = time.monotonic()
    episodes = await loop.run_batch(insts, args.samples_per_prompt)
    wall = time.monotonic() - t0
    finish = [e.time - t0 for e in events if e.kind == "trajectory_finished"]
    reward = [e.time - t0 for e in events if e.kind == "reward"]
    per_ep = []
    rewards: list[float] = []
    for ep in episodes:
        outcome = ep.reward
        assert outcome is not None and outcome.reward is not None  # scripted: correct, never dropped
        rewards.append(outcome.reward)
        total = ep.finished_at - ep.started_at + outcome.duration_s
        parts = {
            "generation_s": ep.generation_s,
            "tool_s": ep.tool_s,
            "verifier_s": outcome.duration_s,
        }
        per_ep.append(
            {
                **parts,
                "other_s": total - sum(parts.values()),
                "total_s": total,
                "turns": len(ep.turns),
            }
        )
    mean = {k: statistics.fmean(p[k] for p in per_ep) for k in per_ep[0]}
    return {
        "task": name,
        "episodes": len(episodes),
        "mean_reward": statistics.fmean(rewards),
        "batch_wall_s": wall,
        "mean_episode": mean,
        "trajectory_finished_s": _quantiles(finish),
        "reward_arrived_s": _quantiles(reward),
        "mean_tokens": statistics.fmean(len(ep.token_ids) for ep in episodes),
        "mean_generated_tokens": statistics.fmean(
            sum(t.end - t.start for t in ep.turns) for ep in episodes
        ),
    }


async def _sandbox_cost(isolation: str, root_dir: str, n: int) -> float:
    from megathunder.rollout.sandbox import LocalSandbox

    sb = LocalSandbox(LocalSandboxConfig(isolation=isolation, root_dir=root_dir))
    try:
        await sb.shell("true")
        t0 = time.perf_counter()
        for _ in range(n):
            await sb.shell("true")
        return (time.perf_counter() - t0) / n
    finally:
        await sb.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="megathunder bench episodes", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--num-instances", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seconds-per-token", type=float, default=0.002, help="simulated decode time")
    p.add_argument("--isolation", choices=("bwrap", "unshare"), default="bwrap")
    p.add_argument("--root-dir", default="/tmp/megathunder-bench-sandboxes")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    sandbox_cfg = LocalSandboxConfig(
        isolation=args.isolation, root_dir=args.root_dir, num_uids=max(256, args.concurrency)
    )
    can_sandbox = os.geteuid() == 0
    results, skipped = [], []
    for name in args.tasks.split(","):
        needs = name in ("swe_local", "terminal")
        if needs and not can_sandbox:
            skipped.append(f"{name} (the local sandbox needs root)")
            continue
        results.append(asyncio.run(_run_task(name, args, sandbox_cfg)))

    print(
        f"scripted policy (not a model), simulated decode {args.seconds_per_token * 1e3:g} ms/token; "
        f"{args.num_instances} instances x {args.samples_per_prompt} samples, "
        f"{args.concurrency} concurrent; sandbox {args.isolation}"
    )
    header = ("task", "reward", "turns", "gen s", "tool s", "verif s", "other s")
    print(f"{header[0]:<11}" + "".join(f" {h:>7}" for h in header[1:]), end="")
    print(" | finish p10/p50/p90/max s      | reward p50/max s")
    for r in results:
        m, f, w = r["mean_episode"], r["trajectory_finished_s"], r["reward_arrived_s"]
        cols = (
            r["mean_reward"],
            m["turns"],
            m["generation_s"],
            m["tool_s"],
            m["verifier_s"],
            m["other_s"],
        )
        finish = " / ".join(f"{f[q]:.3f}" for q in ("p10", "p50", "p90", "max"))
        print(f"{r['task']:<11}" + "".join(f" {c:>7.3f}" for c in cols), end="")
        print(f" | {finish} | {w['p50']:.3f} / {w['max']:.3f}")
    cost = {}
    if can_sandbox:
        for iso in ("bwrap", "unshare"):
            if shutil.which("bwrap" if iso == "bwrap" else "unshare"):
                cost[iso] = asyncio.run(_sandbox_cost(iso, args.root_dir, 20))
        print(
            "sandbox cost per command (`true`): "
            + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in cost.items())
        )
    for s in skipped:
        print(f"skipped: {s}")
    print(
        json.dumps(
            {
                "bench": "episodes",
                "args": vars(args),
                "tasks": results,
                "sandbox_exec_s": cost,
                "skipped": skipped,
            }
        )
    )
    return 0
