"""Decoder models, config-driven, one module per concept."""

from declattn.engine.models.config import (
    SUPPORTED_ARCHITECTURES,
    ConfigError,
    ModelConfig,
    RopeConfig,
    UnsupportedArchitecture,
)
from declattn.engine.models.decoder import Decoder

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ConfigError",
    "Decoder",
    "ModelConfig",
    "RopeConfig",
    "UnsupportedArchitecture",
]
