"""Configuration: YAML files in ``configs/`` plus ``key=value`` overrides, validated at parse time."""

from megathunder.config.loader import ConfigError, load_config, parse_overrides
from megathunder.config.schema import (
    BatchConfig,
    Config,
    LearnerConfig,
    LearnerOptimizerConfig,
    LedgerConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimizerConfig,
    ParallelConfig,
    PolicyModelConfig,
    PrecisionConfig,
    ReferenceModelConfig,
    RolloutConfig,
    RunConfig,
    ScheduleConfig,
)

__all__ = [
    "BatchConfig",
    "Config",
    "ConfigError",
    "LearnerConfig",
    "LearnerOptimizerConfig",
    "LedgerConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PolicyModelConfig",
    "PrecisionConfig",
    "ReferenceModelConfig",
    "RolloutConfig",
    "RunConfig",
    "ScheduleConfig",
    "load_config",
    "parse_overrides",
]
