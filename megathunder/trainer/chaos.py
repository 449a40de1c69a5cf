"""Fault injection (``chaos.faults``): the faults RELIABILITY.md says a run survives, made to happen
at a chosen moment of a real run, so recovery can be tried rather than trusted.

Each fault fires once, at the step it names: server faults (``kill_server``: SIGKILL,
``hang_server``: SIGSTOP of a launched rollout server's process group) when ``after_trajectories``
of the step's trajectories have finished, while the rest of the batch is still generating; the
others after the step's records are written (``fill_disk``: a file in the run directory grows
until the file system is full, so the next write -- journal, metrics, checkpoint -- meets a real
ENOSPC; ``sigusr1`` / ``sigint``: the signal to this process, which stops after the step with a
checkpoint). What the run then does is the recovery under test: servers' requests move to live
ones with their seeds (the same episodes), a full disk stops the run with one line and an intact
last checkpoint, a signal stops it resumably.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
from pathlib import Path

from megathunder.config import ChaosFault
from megathunder.rollout.engines.server import ServerEngine
from megathunder.rollout.types import RolloutEngine

log = logging.getLogger(__name__)

FILLER = ".chaos_fill"
"""The file ``fill_disk`` grows in the run directory (delete it to free the space)."""


RECORD = "chaos.jsonl"
"""Faults fired, one JSON line each, written before the fault: a resumed run (the same command)
does not fire them again."""


class Chaos:
    def __init__(self, faults: list[ChaosFault], out: Path, engine: RolloutEngine) -> None:
        self.out, self.engine = out, engine
        record = out / RECORD
        fired = [json.loads(line) for line in record.read_text().splitlines()] if record.is_file() else []
        self.pending = [f for i, f in enumerate(faults) if not any(r["index"] == i for r in fired)]
        self._index = {id(f): i for i, f in enumerate(faults)}

    def trajectory_finished(self, step: int, num_finished: int) -> None:
        for fault in self._due(lambda f: f.kind in ("kill_server", "hang_server") and f.step == step
                               and num_finished >= f.after_trajectories):
            self._server(fault)

    def after_step(self, step: int) -> None:
        for fault in self._due(lambda f: f.kind not in ("kill_server", "hang_server") and f.step == step):
            log.warning("chaos: %s after step %d", fault.kind, step)
            if fault.kind == "fill_disk":
                fill_disk(self.out / FILLER)
            else:
                os.kill(os.getpid(), signal.SIGUSR1 if fault.kind == "sigusr1" else signal.SIGINT)

    def _due(self, when) -> list[ChaosFault]:
        due = [f for f in self.pending if when(f)]
        self.pending = [f for f in self.pending if f not in due]
        if due:
            with open(self.out / RECORD, "a") as f:
                for fault in due:
                    f.write(json.dumps({"index": self._index[id(fault)], **fault.model_dump()}) + "\n")
        return due

    def _server(self, fault: ChaosFault) -> None:
        engine = self.engine
        assert isinstance(engine, ServerEngine) and engine.pool is not None, "checked by the config"
        process = engine.pool.servers[fault.server].process
        log.warning("chaos: %s server %d (%s) at step %d", fault.kind, fault.server, engine.urls[fault.server],
                    fault.step)
        os.killpg(process.pid, signal.SIGKILL if fault.kind == "kill_server" else signal.SIGSTOP)


def fill_disk(path: Path) -> int:
    """Grow ``path`` until its file system has no space left; returns the bytes written."""
    written, chunk = 0, 1 << 24
    with open(path, "ab", buffering=0) as f:
        while chunk:
            try:
                written += f.write(b"\0" * chunk)
            except OSError as err:
                if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                chunk //= 2
    return written
