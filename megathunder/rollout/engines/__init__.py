"""vLLM rollout engines: in-process (``AsyncLLM``) and disaggregated (OpenAI-compatible servers).

Both implement ``megathunder.rollout.types.RolloutEngine`` (and ``WeightReceiver``, the engine's end
of a streamed weight push); :func:`start_engine` picks one from ``EngineConfig.deployment``. vLLM is
imported only when an engine starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from megathunder.config import EngineConfig
from megathunder.rollout.engines.inprocess import InProcessEngine
from megathunder.rollout.engines.server import ServerEngine
from megathunder.rollout.types import Revive, RolloutEngine


async def start_engine(
    cfg: EngineConfig, model_path: str | Path | None, log_dir: str | Path = "logs", policy_version: int = 0,
    *, senders: Literal["engine", "learner"] = "engine", revive: Revive | None = None,
) -> RolloutEngine:
    """Start (or attach to) the engine ``cfg`` describes; ``await engine.close()`` when done.
    ``senders``: who sends weights over the transfer groups -- this process (``"engine"``: tensors
    in memory), or the learner's stage senders (``"learner"``, training: the owner opens the groups,
    ``WeightSync.connect``). ``revive``: awaited with the engine once a dead in-process engine core
    has been started again, to load the owner's weights into it (without it none is restarted)."""
    if cfg.deployment == "in_process":
        if model_path is None:
            raise ValueError("model_path is needed for the in-process engine")
        return await InProcessEngine.start(str(model_path), cfg, policy_version, senders=senders, revive=revive)
    return await ServerEngine.start(
        None if model_path is None else str(model_path), cfg, log_dir, policy_version, senders=senders
    )
