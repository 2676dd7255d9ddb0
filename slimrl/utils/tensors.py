"""`NamedTensors`: the one name for what every weight path carries (HF names with their tensors)."""

from __future__ import annotations

import torch

NamedTensors = list[tuple[str, torch.Tensor]]
"""(HF parameter name, tensor) pairs, in the order they are sent or written."""
