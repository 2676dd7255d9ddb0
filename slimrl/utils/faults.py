"""Fault points: the few places where a test (or a drill on a cluster) makes a component fail the
way a real fault would, from outside, by environment variable. Unset, each is one dict lookup.

* `SLIMRL_FAULT_CORRUPT_UPDATE=<name part>@<version>[x<times>][,...]`: the weight sync of that version
  flips the bytes of 64 elements of every pushed tensor whose HF name contains `<name part>`, on
  its way to the engines (the trainer's weights stay intact), in the first `<times>` pushes of
  that version (default every push); each push flips the next 64 elements, as faults in flight
  strike anywhere.

* `SLIMRL_FAULT_NONFINITE_GRAD=<step>[,<step>...]`: in those optimizer steps of a trainer (1-based,
  counted per process), trainer rank 0 writes NaN into its first gradient after the backward pass.

* `SLIMRL_FAULT_HANG_SYNC=<version>`: in the weight sync of that version, trainer rank 1 stops
  before its first exchange and never comes back (the others wait for it in a collective).

Ray actors get these from the driver's environment (`placement.worker_env`).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a fault acts: the driver, Ray's probes and the router import this
    import torch

CORRUPT_UPDATE = "SLIMRL_FAULT_CORRUPT_UPDATE"
NONFINITE_GRAD = "SLIMRL_FAULT_NONFINITE_GRAD"
HANG_SYNC = "SLIMRL_FAULT_HANG_SYNC"
FAULT_VARS = (CORRUPT_UPDATE, NONFINITE_GRAD, HANG_SYNC)
_SPEC = re.compile(r"^(?P<name>[^@]+)@(?P<version>[^x]+)(?:x(?P<times>\d+))?$")
_pushes: dict[tuple[str, str], int] = {}
"""(version, tensor) -> how often this process pushed it (each tensor has one owner rank)."""


def corrupt_update(unit: Sequence[tuple[str, torch.Tensor]], version: str) -> list[tuple[str, torch.Tensor]]:
    """`unit` as the fault point says it reaches the engines in the sync of `version`."""
    out = list(unit)
    for spec in filter(None, os.environ.get(CORRUPT_UPDATE, "").split(",")):
        match = _SPEC.match(spec)
        if match is None or match["version"] != str(version):
            continue
        hits = [name for name, _ in out if match["name"] in name]
        if not hits:
            continue
        key = (str(version), hits[0])
        _pushes[key] = _pushes.get(key, 0) + 1
        if match["times"] is None or _pushes[key] <= int(match["times"]):
            out = [(name, _flipped(t, _pushes[key] - 1) if name in hits else t) for name, t in out]
    return out


def _flipped(tensor: torch.Tensor, push: int) -> torch.Tensor:
    out = tensor.detach().clone()
    flat = out.reshape(-1)
    start = 64 * push % max(flat.numel() - 64, 1)
    import torch

    flat[start : start + 64].view(torch.uint8).bitwise_not_()
    return out


def nonfinite_grad(grads: Sequence[torch.Tensor], step: int, rank: int) -> None:
    """NaN into `grads[0]` on rank 0 if the fault point names optimizer step `step`."""
    steps = {int(s) for s in os.environ.get(NONFINITE_GRAD, "").split(",") if s.strip().isdigit()}
    if rank == 0 and step in steps and grads:
        grads[0].view(-1)[0] = float("nan")


def hang_sync(version: str, rank: int) -> None:
    """Never returns on trainer rank 1 if the fault point names this sync's version."""
    if rank == 1 and os.environ.get(HANG_SYNC) == str(version):
        threading.Event().wait()
