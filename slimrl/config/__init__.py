"""Typed configuration: schema, loading with overrides, cross-section checks."""

from slimrl.config.loader import load_config, save_config
from slimrl.config.schema import SlimConfig

__all__ = ["SlimConfig", "load_config", "save_config"]
