"""The typed configuration schema (`schema.py`), read by every floor. Loading, checking and
finalising a config is the gate's (`slimrl/preflight/`)."""

from slimrl.config.schema import SlimConfig

__all__ = ["SlimConfig"]
