"""The package type-checks: ``python -m mypy`` (its configuration: ``[tool.mypy]`` in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_mypy_is_clean():
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[test]')")
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, f"mypy found problems:\n{proc.stdout}{proc.stderr}"
