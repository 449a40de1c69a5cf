import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """Tier by folder: tests/unit -> unit, tests/integration -> integration, and so on."""
    for item in items:
        parts = item.path.parts
        for tier in ("unit", "integration", "distributed", "cluster", "gpu"):
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
