"""The gate on top: a config file and overrides in, a checked `SlimConfig` out (`loader.py`), every
rule that can be checked before anything starts (`checks.py`, reading the model's config.json, the
data files, the hooks, the device ledger and the engine plan), and the values a run derives once
(`finalize.py`). It sits above everything it checks; the schema it fills (`slimrl/config/`) sits
at the bottom, so every floor can read a config without importing the gate."""

from slimrl.preflight.finalize import finalize
from slimrl.preflight.loader import load_config, save_config

__all__ = ["finalize", "load_config", "save_config"]
