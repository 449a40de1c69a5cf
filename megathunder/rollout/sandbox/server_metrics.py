"""What a sandbox server counts, and its ``/metrics`` in Prometheus text or JSON.

Counts: sandboxes open per state (``creating``, ``ready``: open and idle, ``busy``: a command,
upload or download in flight, ``closing``), episodes (sandboxes created; one per episode),
creates that failed, creates refused at the bound, sandboxes destroyed per reason (``client``,
``idle``: no request for ``idle_timeout_s``, ``shutdown``), commands run; and per operation
(``create``, ``exec``, ``upload``, ``download``, ``destroy``) the latency's count, sum and its 50th
and 99th percentiles over the last :data:`WINDOW` samples (nearest rank).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from typing import Any

WINDOW = 10_000
OPS = ("create", "exec", "upload", "download", "destroy")
STATES = ("creating", "ready", "busy", "closing")


def percentile(samples: Iterable[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``samples``; 0.0 for none."""
    ordered = sorted(samples)
    if not ordered:
        return 0.0
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class Latencies:
    """Per operation: how many, their total seconds, and the last :data:`WINDOW` samples."""

    def __init__(self) -> None:
        self.samples: dict[str, deque[float]] = {op: deque(maxlen=WINDOW) for op in OPS}
        self.count: Counter[str] = Counter()
        self.total_s: dict[str, float] = dict.fromkeys(OPS, 0.0)

    def add(self, op: str, seconds: float) -> None:
        self.samples[op].append(seconds)
        self.count[op] += 1
        self.total_s[op] += seconds

    def summary(self) -> dict[str, dict[str, float]]:
        return {op: {"count": self.count[op], "sum": round(self.total_s[op], 6),
                     "p50": round(percentile(self.samples[op], 0.5), 6),
                     "p99": round(percentile(self.samples[op], 0.99), 6)} for op in OPS}


class ServerCounts:
    """The server's counters (the states of open sandboxes are read from its registry)."""

    def __init__(self) -> None:
        self.episodes = 0
        self.create_failures = 0
        self.rejected = 0
        self.commands = 0
        self.destroyed: Counter[str] = Counter()
        self.latency = Latencies()

    def as_json(self, server_id: str, backend: str, max_sandboxes: int, states: Mapping[str, int]) -> dict[str, Any]:
        return {"server_id": server_id, "backend": backend, "max_sandboxes": max_sandboxes,
                "open": {s: states.get(s, 0) for s in STATES}, "episodes_total": self.episodes,
                "create_failures_total": self.create_failures, "rejected_total": self.rejected,
                "commands_total": self.commands, "destroyed_total": dict(self.destroyed),
                "latency_s": self.latency.summary()}


def prometheus(metrics: Mapping[str, Any]) -> str:
    """``ServerCounts.as_json`` as Prometheus text exposition."""
    p = "megathunder_sandbox"
    lines = [f"# TYPE {p}_max gauge", f"{p}_max {metrics['max_sandboxes']}", f"# TYPE {p}_open gauge"]
    lines += [f'{p}_open{{state="{s}"}} {n}' for s, n in metrics["open"].items()]
    for name in ("episodes_total", "create_failures_total", "rejected_total", "commands_total"):
        lines += [f"# TYPE {p}_{name} counter", f"{p}_{name} {metrics[name]}"]
    lines.append(f"# TYPE {p}_destroyed_total counter")
    lines += [f'{p}_destroyed_total{{reason="{r}"}} {n}' for r, n in sorted(metrics["destroyed_total"].items())]
    lines.append(f"# TYPE {p}_latency_seconds summary")
    for op, s in metrics["latency_s"].items():
        lines += [f'{p}_latency_seconds{{op="{op}",quantile="0.5"}} {s["p50"]}',
                  f'{p}_latency_seconds{{op="{op}",quantile="0.99"}} {s["p99"]}',
                  f'{p}_latency_seconds_sum{{op="{op}"}} {s["sum"]}',
                  f'{p}_latency_seconds_count{{op="{op}"}} {s["count"]}']
    return "\n".join(lines) + "\n"


__all__ = ["OPS", "STATES", "Latencies", "ServerCounts", "percentile", "prometheus"]
