"""The run journal: every trajectory a run trained on, append-only and crash-consistent.

One JSON record per line, each carrying the CRC32 of its own payload:

    {"crc": 1234567, "rec": {"type": "trajectory", "step": 3, "traj_id": 5, ...}}

A line that does not parse or whose CRC does not match is a record torn by a crash mid-write: it
is reported and skipped when the journal is read. A step's trajectory records are written with its
``step`` record, in one write, and the file is fsync'ed then, so after a crash everything up to the
last completed step is on disk. A step's trajectories count only once its ``step`` record follows them; on resume the
journal is cut back to the steps the checkpoint holds, so a resumed run appends exactly what the
uninterrupted run would have.

Record types: ``trajectory`` (tokens, loss mask, rollout logprobs, reward, timings, policy
versions, and ``verifier``: how the reward followed and, for test-suite tasks, each graded test's
status) and ``step`` (the step's metrics, written after its optimizer step).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import zlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megathunder.diskspace import close_quietly, writing
from megathunder.trajectory import Trajectory, mask_spans

log = logging.getLogger(__name__)


def _line(rec: dict) -> str:
    payload = json.dumps(rec, separators=(",", ":"))
    return f'{{"crc":{zlib.crc32(payload.encode())},"rec":{payload}}}\n'


def read_records(path: str | Path) -> list[dict]:
    """Every intact record, in order; torn or corrupted lines are logged and skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                obj = json.loads(raw)
                payload = json.dumps(obj["rec"], separators=(",", ":"))
                if zlib.crc32(payload.encode()) != obj["crc"]:
                    raise ValueError("CRC mismatch")
            except (ValueError, KeyError, TypeError) as err:
                log.warning("journal %s line %d: skipped a torn or corrupted record (%s)", path, lineno, err)
                continue
            out.append(obj["rec"])
    return out


class Journal:
    """Appends to ``path``; ``keep_steps`` cuts an existing journal back to steps < keep_steps."""

    def __init__(self, path: str | Path, keep_steps: int = 0) -> None:
        self.path = Path(path)
        kept = [r for r in read_records(self.path) if r.get("step", -1) < keep_steps]
        tmp = self.path.with_suffix(".tmp")
        with writing(self.path):
            tmp.write_text("".join(_line(r) for r in kept))
            os.replace(tmp, self.path)
        self._f = open(self.path, "a")
        self._step_lines: list[str] = []  # the open step's trajectory records, written at ``end_step``

    def append(self, rec: dict) -> None:
        with writing(self.path):
            self._f.write("".join(self._step_lines) + _line(rec))
            self._f.flush()
        self._step_lines = []

    def trajectory(self, step: int, traj: Trajectory, **fields) -> None:
        """A trajectory of step ``step``; written with the step's ``end_step`` (or at ``close``)."""
        self._step_lines.append(_line({
            "type": "trajectory", "step": step, "traj_id": traj.traj_id, "group_id": traj.group_id,
            "tokens": traj.tokens.tolist(), "loss_mask": mask_spans(traj.loss_mask),
            "rollout_logprobs": traj.rollout_logprobs.tolist()
            if traj.rollout_logprobs is not None else None,
            "truncated": traj.truncated, **_routing_fields(traj), **fields,
        }))  # fmt: skip

    def end_step(self, step: int, metrics: dict) -> None:
        self.append({"type": "step", "step": step, "metrics": metrics})
        with writing(self.path):
            os.fsync(self._f.fileno())

    def close(self) -> None:
        try:
            if self._step_lines:  # a step that did not end: its records, which do not count
                self._f.write("".join(self._step_lines))
        except OSError:
            pass  # a full disk: what is lost would not have counted
        finally:
            self._step_lines = []
            close_quietly(self._f)


def _routing_fields(traj: Trajectory) -> dict:
    """Routing replay's experts per input position, as base64 int16 and its shape (replaying the
    journal replays them too); nothing when the trajectory has none."""
    if traj.routed_experts is None:
        return {}
    rows = traj.routed_experts.to(torch.int16).contiguous()
    return {"routed_experts": base64.b64encode(rows.numpy().tobytes()).decode(), "routed_shape": list(rows.shape)}


def _routing(rec: dict) -> torch.Tensor | None:
    if "routed_experts" not in rec:
        return None
    rows = np.frombuffer(base64.b64decode(rec["routed_experts"]), dtype=np.int16).reshape(rec["routed_shape"])
    return torch.from_numpy(rows.copy())


def _mask(spans: list[list[int]], n: int) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    for a, b in spans:
        mask[a:b] = True
    return mask


@dataclass
class JournalEntry:
    traj: Trajectory
    reward: float | None  # None: failed (its group is dropped)
    t_finished: float  # seconds since the batch started
    t_reward: float
    policy_versions: list[int]


def to_entry(rec: dict) -> JournalEntry:
    tokens = torch.tensor(rec["tokens"], dtype=torch.int64)
    n = tokens.numel() - 1
    logp = rec.get("rollout_logprobs")
    traj = Trajectory(
        traj_id=rec["traj_id"], group_id=rec["group_id"], tokens=tokens, loss_mask=_mask(rec["loss_mask"], n),
        rollout_logprobs=None if logp is None else torch.tensor(logp, dtype=torch.float32),
        truncated=rec["truncated"], routed_experts=_routing(rec),
    )
    return JournalEntry(traj, rec["reward"], rec["t_finished"], rec["t_reward"], rec.get("policy_versions", []))


def completed_steps(path: str | Path) -> Iterator[tuple[int, list[JournalEntry], dict]]:
    """(step, its trajectories in sample order, its metrics) for every step whose record exists."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    steps = []
    for rec in read_records(path):
        if rec["type"] == "trajectory":
            by_step[rec["step"]].append(rec)
        elif rec["type"] == "step":
            steps.append(rec)
    for rec in sorted(steps, key=lambda r: r["step"]):
        entries = sorted((to_entry(r) for r in by_step[rec["step"]]), key=lambda e: e.traj.traj_id)
        yield rec["step"], entries, rec["metrics"]
