"""The run's device kind: `cluster.device`, with `auto` resolved on this machine."""

from __future__ import annotations

from slimrl.config.schema import SlimConfig


def resolve_device(config: SlimConfig) -> str:
    """`cuda` or `cpu`: the config's choice, or for `auto` CUDA when a GPU is visible here."""
    if config.cluster.device != "auto":
        return config.cluster.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
