"""The run's config: typed dataclasses, YAML + dotted overrides. A leaf: it imports nothing of the package."""
from .schema import (
    JOB_ALIASES, JOBS, ActorConfig, AlgorithmConfig, ConfigError, CriticConfig, DataConfig, DistillConfig, KLControlConfig,
    LoraConfig, ModelConfig, OptimConfig, ParallelConfig, PolicyLossConfig, PythonSandboxConfig, RewardConfig, RolloutConfig,
    RolloutCorrectionConfig, ToolsConfig, TrainConfig, TrainerConfig, UpdateSchedule, ValueLossConfig, load_config,
    to_dict, to_yaml,
)

__all__ = [
    "JOB_ALIASES", "JOBS", "ActorConfig", "AlgorithmConfig", "ConfigError", "CriticConfig", "DataConfig",
    "KLControlConfig", "LoraConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "PolicyLossConfig", "PythonSandboxConfig",
    "RewardConfig", "RolloutConfig", "RolloutCorrectionConfig", "ToolsConfig", "TrainConfig", "TrainerConfig",
    "UpdateSchedule", "ValueLossConfig", "load_config", "to_dict", "to_yaml",
]
