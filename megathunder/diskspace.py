"""A full disk stops a run with one line naming the path, and never costs the last checkpoint.

Every file a run appends to or replaces (the journal, metrics.jsonl, checkpoints, their ``latest``
marker) is written through :func:`writing`, which turns "no space left on device" (ENOSPC, or a
quota's EDQUOT) into :class:`DiskFullError` naming the path. Writes that can be cut short are
atomic: a checkpoint goes to ``step_N.tmp`` and is renamed when complete, ``latest`` is replaced by
rename, so a write that fails leaves the previous state readable (``megathunder.learner.checkpoint``).
``megathunder train`` prints the error as one line and exits 1; after freeing space the same command
resumes from the last complete checkpoint, cutting the journal back to it.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NEARLY_FULL_BYTES = 1 << 20
"""Free space below which a failed write counts as the disk's fault (torch's zip writer reports
ENOSPC as a RuntimeError without an errno)."""


class DiskFullError(RuntimeError):
    """The file system holding ``path`` is full."""

    def __init__(self, path: str | Path, detail: str = "") -> None:
        self.path = Path(path)
        super().__init__(f"no space left on device writing {path}{detail}; free space and run the same command "
                         "again: it resumes from the last complete checkpoint")


def is_full(path: str | Path) -> bool:
    """Whether the file system of ``path`` (or of its nearest existing parent) is (nearly) full."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free < NEARLY_FULL_BYTES
    except OSError:
        return False


@contextmanager
def writing(path: str | Path, detail: str = "") -> Iterator[None]:
    """Run a write to ``path``; a full disk raises :class:`DiskFullError` (other errors pass)."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as err:
        if err.errno in FULL_ERRNOS:
            raise DiskFullError(path, detail) from err
        raise
    except RuntimeError as err:  # torch.save's writer: "file write failed", no errno
        if is_full(path):
            raise DiskFullError(path, detail) from err
        raise


def replace_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a temporary file renamed over it)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with writing(path):
        tmp.write_text(text)
        os.replace(tmp, path)


def close_quietly(f) -> None:
    """Close a file whose last write may have failed on a full disk (its buffer cannot be flushed:
    the error was reported by the write)."""
    try:
        f.close()
    except OSError as err:
        if err.errno not in FULL_ERRNOS:
            raise
