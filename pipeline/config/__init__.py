"""Typed run configuration: YAML recipe + dotted command-line overrides.

Every section is a frozen dataclass (sections.py); the loader (load.py) checks
unknown keys, types and ranges, then the rules between keys (checks.py), and
names the offending key in its error. This module is the package's face: it
only re-exports what callers use.
"""
from __future__ import annotations

from pipeline.config.load import MOVED, load_config
from pipeline.config.sections import (
    YAML_NAMES, AgentConfig, Config, ConfigError, DataConfig, EnvConfig, FaultConfig, GenerationConfig, InjectConfig,
    LoraConfig, MetricsConfig, ModelConfig, PolicyLossConfig, PpoConfig, ResourcesConfig, RoleResources, RunConfig,
    ScheduleConfig, SimConfig, TrainingConfig, ValidationConfig,
)

__all__ = [
    "MOVED", "YAML_NAMES", "AgentConfig", "Config", "ConfigError", "DataConfig", "EnvConfig", "FaultConfig", "GenerationConfig",
    "InjectConfig", "LoraConfig", "MetricsConfig", "ModelConfig", "PolicyLossConfig", "PpoConfig", "ResourcesConfig",
    "RoleResources", "RunConfig", "ScheduleConfig", "SimConfig", "TrainingConfig", "ValidationConfig",
    "load_config",
]
