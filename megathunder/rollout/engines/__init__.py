"""vLLM rollout engines: in-process (``AsyncLLM``) and disaggregated (OpenAI-compatible servers).

Both implement ``megathunder.rollout.types.RolloutEngine``; :func:`start_engine` picks one from
``EngineConfig.deployment``. vLLM is imported only when an engine starts.
"""

from __future__ import annotations

from pathlib import Path

from megathunder.config import EngineConfig
from megathunder.rollout.engines.inprocess import InProcessEngine
from megathunder.rollout.engines.server import ServerEngine
from megathunder.rollout.engines.transfer import StageSenders
from megathunder.rollout.types import RolloutEngine


async def start_engine(
    cfg: EngineConfig, model_path: str | Path | None, log_dir: str | Path = "logs", policy_version: int = 0,
    senders: StageSenders | None = None,
) -> RolloutEngine:
    """Start (or attach to) the engine ``cfg`` describes; ``await engine.close()`` when done.
    ``senders``: the learner's stage senders join the weight-transfer groups (training); without
    them this process is the groups' one sender (in-memory tensors)."""
    if cfg.deployment == "in_process":
        if model_path is None:
            raise ValueError("model_path is needed for the in-process engine")
        return await InProcessEngine.start(str(model_path), cfg, policy_version, senders)
    return await ServerEngine.start(
        None if model_path is None else str(model_path), cfg, log_dir, policy_version, senders
    )
