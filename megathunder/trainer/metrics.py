"""Per-step metrics: a JSONL file in the run directory, and wandb (offline by default)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from megathunder.diskspace import close_quietly, writing
from megathunder.config import Config

log = logging.getLogger(__name__)


class MetricsLog:
    def __init__(self, out_dir: Path, cfg: Config, keep_steps: int = 0, enabled: bool = True) -> None:
        """``keep_steps``: on resume, rows of steps >= keep_steps are dropped (they are redone)."""
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
        self.rows: list[dict] = []
        if not enabled:
            return
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line torn by a crash
                if row.get("step", -1) < keep_steps:
                    self.rows.append(row)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        self._f = open(self.path, "a")
        self._wandb = None
        if cfg.run.wandb != "disabled":
            try:
                import wandb
            except ImportError:
                log.warning("run.wandb=%s but wandb is not installed: logging to %s only", cfg.run.wandb, self.path)
            else:
                os.environ.setdefault("WANDB_SILENT", "true")
                self._wandb = wandb.init(
                    project=cfg.run.wandb_project, dir=str(out_dir), mode=cfg.run.wandb,
                    config=cfg.model_dump(mode="json"), name=out_dir.name, resume="allow",
                    id=_run_id(out_dir), settings=wandb.Settings(console="off"),
                )  # fmt: skip

    def log(self, row: dict) -> None:
        self.rows.append(row)
        if not self.enabled:
            return
        with writing(self.path):
            self._f.write(json.dumps(row) + "\n")
            self._f.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=row["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        close_quietly(self._f)
        if self._wandb is not None:
            self._wandb.finish()


def _run_id(out_dir: Path) -> str:
    """One wandb run id per run directory, kept across resumes."""
    f = out_dir / ".wandb_id"
    if not f.is_file():
        import uuid

        f.write_text(uuid.uuid4().hex[:12])
    return f.read_text().strip()
