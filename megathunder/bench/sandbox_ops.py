"""``megathunder bench sandbox``: what a sandbox costs where it runs -- on the controller (the
``local`` runtime in-process) against one and two sandbox servers on loopback (``megathunder
sandbox serve``, each its own process, the same runtime, reached over HTTP with its token).

Each episode creates a sandbox, runs ``--commands`` short commands in it (``sh -c 'echo ...'``),
and destroys it; ``--concurrency`` episodes run at once, ``--episodes`` in all. Reported per
setup: create, exec and destroy latency as the controller sees it (p50 / p99, nearest rank, in
ms) and episodes per second over the whole run. The last line is one JSON object.

    megathunder bench sandbox [--episodes 64] [--concurrency 16] [--commands 4] [--servers 0 1 2]

The local runtime needs root (a uid per sandbox) and bubblewrap; the figures are the sandbox
layer's own overhead (the commands do nothing), not a task's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

KEY_ENV = "MT_BENCH_SANDBOX_KEY"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile_ms(samples: list[float], q: float) -> float:
    from megathunder.rollout.sandbox.server_metrics import percentile

    return round(1000 * percentile(samples, q), 2)


def _runtime(root: str) -> dict:
    return {"backend": "local", "root_dir": root, "wall_time_s": 30, "cpu_time_s": 10, "memory_mb": 512,
            "max_processes": 64, "num_uids": 256}


async def _episodes(cfg, args: argparse.Namespace) -> dict:
    from megathunder.rollout.sandbox import build_sandbox, close_sandbox_pools

    lat: dict[str, list[float]] = {"create": [], "exec": [], "destroy": []}
    slots = asyncio.Semaphore(args.concurrency)

    async def one(k: int) -> None:
        async with slots:
            t = time.perf_counter()
            sb = await build_sandbox(cfg)
            lat["create"].append(time.perf_counter() - t)
            try:
                for j in range(args.commands):
                    t = time.perf_counter()
                    r = await sb.exec(["sh", "-c", f"echo episode {k} command {j}"])
                    lat["exec"].append(time.perf_counter() - t)
                    if not r.ok:
                        raise RuntimeError(f"episode {k}: {r.observation()}")
            finally:
                t = time.perf_counter()
                await sb.close()
                lat["destroy"].append(time.perf_counter() - t)

    start = time.perf_counter()
    try:
        await asyncio.gather(*(one(k) for k in range(args.episodes)))
    finally:
        await close_sandbox_pools()
    wall = time.perf_counter() - start
    out: dict = {"episodes_per_s": round(args.episodes / wall, 2), "seconds": round(wall, 2)}
    for op, samples in lat.items():
        out[op] = {"p50_ms": _percentile_ms(samples, 0.5), "p99_ms": _percentile_ms(samples, 0.99), "n": len(samples)}
    return out


def _serve(config: Path, port: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megathunder.cli", "sandbox", "serve", str(config), "--port", str(port)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, within_s: float = 120.0) -> None:
    import urllib.request

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sandbox server {url} exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"sandbox server {url} not healthy in {within_s:g} s")


def _setup(num_servers: int, args: argparse.Namespace, work: Path) -> dict:
    """One setup's figures: the local runtime here (0 servers) or ``num_servers`` servers."""
    import yaml

    from megathunder.config import LocalSandboxConfig, RemoteSandboxConfig

    root = f"/tmp/megathunder-bench-sandbox-{uuid.uuid4().hex[:8]}"
    try:
        if num_servers == 0:
            return asyncio.run(_episodes(LocalSandboxConfig.model_validate(_runtime(root)), args))
        per_server = max(1, -(-args.concurrency // num_servers))
        base = {"backend": "remote", "runtime": _runtime(root), "api_key_env": KEY_ENV, "state_dir": str(work / "state"),
                "max_sandboxes_per_server": per_server}
        config = work / f"serve-{num_servers}.yaml"
        config.write_text(yaml.safe_dump({"sandbox": base}))
        ports = [_free_port() for _ in range(num_servers)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        procs = [_serve(config, p, work / f"server-{num_servers}-{i}.log") for i, p in enumerate(ports)]
        try:
            for url, proc, i in zip(urls, procs, range(num_servers), strict=True):
                _wait_healthy(url, proc, work / f"server-{num_servers}-{i}.log")
            cfg = RemoteSandboxConfig.model_validate({**base, "server_urls": urls})
            return asyncio.run(_episodes(cfg, args))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)  # every sandbox destroyed, then it exits
            for proc in procs:
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="megathunder bench sandbox", description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--commands", type=int, default=4, help="commands per episode")
    p.add_argument("--servers", type=int, nargs="+", default=[0, 1, 2],
                   help="setups: 0 = the local runtime on the controller, N = N servers on loopback")
    args = p.parse_args(argv)
    os.environ.setdefault(KEY_ENV, uuid.uuid4().hex)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="megathunder-bench-sandbox-") as tmp:
        for n in args.servers:
            name = "local" if n == 0 else f"{n} server{'s' if n > 1 else ''}"
            rows[name] = _setup(n, args, Path(tmp))
    print(f"{args.episodes} episodes, {args.concurrency} at once, {args.commands} commands each (local runtime)")
    print(f"{'setup':<10} {'create p50/p99 ms':>18} {'exec p50/p99 ms':>16} {'destroy p50/p99 ms':>19} {'episodes/s':>11}")
    for name, r in rows.items():
        cells = [f"{r[op]['p50_ms']:.1f}/{r[op]['p99_ms']:.1f}" for op in ("create", "exec", "destroy")]
        print(f"{name:<10} {cells[0]:>18} {cells[1]:>16} {cells[2]:>19} {r['episodes_per_s']:>11.2f}")
    print(json.dumps({"bench": "sandbox", "episodes": args.episodes, "concurrency": args.concurrency,
                      "commands": args.commands, "setups": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
