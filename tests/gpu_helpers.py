"""What the GPU tests measure, for ``tools/gpu_check.sh``'s summary: each test records its figures
(``record``) as a JSON line in the file ``MEGATHUNDER_GPU_FIGURES`` names (nothing when unset: a plain
pytest run), and the check puts them in its one JSON summary."""

from __future__ import annotations

import json
import os

FIGURES_ENV = "MEGATHUNDER_GPU_FIGURES"


def record(check: str, **figures: object) -> None:
    """Append ``{"check": check, **figures}`` to the figures file, if one is set."""
    path = os.environ.get(FIGURES_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"check": check, **figures}, default=float) + "\n")
