"""This process's resident memory from ``/proc/self/status`` (Linux): now, and its peak since the
last :func:`reset_peak` (the kernel's own high-water mark, VmHWM -- exact, no sampling)."""

from __future__ import annotations

import re
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{_STATUS} has no {field} (not Linux?)")
    return int(match.group(1))


def rss_bytes() -> int:
    return _kib("VmRSS") * 1024


def peak_bytes() -> int:
    """The peak resident set since the process started or since :func:`reset_peak`."""
    return _kib("VmHWM") * 1024


def reset_peak() -> None:
    """Set the peak to the current resident set (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")
