"""Configuration: YAML files in ``configs/`` plus ``key=value`` overrides, validated at parse time."""

from megathunder.config.loader import ConfigError, load_config, parse_overrides
from megathunder.config.schema import (
    BatchConfig,
    Config,
    LedgerConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimizerConfig,
    RolloutConfig,
    RunConfig,
    ScheduleConfig,
)

__all__ = [
    "BatchConfig",
    "Config",
    "ConfigError",
    "LedgerConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "OptimizerConfig",
    "RolloutConfig",
    "RunConfig",
    "ScheduleConfig",
    "load_config",
    "parse_overrides",
]
