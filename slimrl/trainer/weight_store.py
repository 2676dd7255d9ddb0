"""Named host-memory snapshots of the model's weights, swapped into the live parameters on demand.

The reference model for KL is the initial policy kept this way: one copy in host memory instead of
a second model on the device; its logprobs are computed by swapping it in and back out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class WeightStore:
    def __init__(self, chunks: list[Any]) -> None:
        self.params = [p for chunk in chunks for p in getattr(chunk, "module", chunk).parameters()]
        self.slots: dict[str, list[torch.Tensor]] = {}

    def save(self, name: str) -> None:
        pin = torch.cuda.is_available()
        self.slots[name] = [
            p.detach().to("cpu", copy=True).pin_memory() if pin else p.detach().to("cpu", copy=True)
            for p in self.params
        ]

    def load(self, name: str) -> None:
        with torch.no_grad():
            for param, saved in zip(self.params, self.slots[name], strict=True):
                param.copy_(saved, non_blocking=True)

    @contextlib.contextmanager
    def swapped_in(self, name: str) -> Iterator[None]:
        """Run with snapshot `name` in the parameters; the current weights come back afterwards."""
        self.save("__live__")
        self.load(name)
        try:
            yield
        finally:
            self.load("__live__")
            del self.slots["__live__"]
