"""Configuration: YAML files in ``configs/`` plus ``key=value`` overrides, validated at parse time."""

from megathunder.config.loader import ConfigError, load_config, parse_overrides
from megathunder.config.schema import (
    AgentLoopConfig,
    BatchConfig,
    Config,
    LedgerConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimizerConfig,
    RolloutConfig,
    RunConfig,
    SandboxConfig,
    ScheduleConfig,
    TaskConfig,
    VerifierConfig,
)

__all__ = [
    "AgentLoopConfig",
    "BatchConfig",
    "Config",
    "ConfigError",
    "LedgerConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "OptimizerConfig",
    "RolloutConfig",
    "RunConfig",
    "SandboxConfig",
    "ScheduleConfig",
    "TaskConfig",
    "VerifierConfig",
    "load_config",
    "parse_overrides",
]
