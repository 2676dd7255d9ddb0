"""The policy losses, by name: the per-token surrogate an RL step minimises (the one list the config
gate and the trainer read; adding a loss is one entry here and its surrogate in
`trainer/algorithms.py`, whose table a test holds to this one).

Torch-free and on the ground floor, like `estimators.py`: the gate checks names and combinations
without importing the trainer."""

from __future__ import annotations

from enum import StrEnum


class PolicyLoss(StrEnum):
    PPO_CLIP = "ppo_clip"
    """PPO's clipped surrogate (Schulman et al. 2017) with clip-higher (`eps_clip_high`, DAPO) and
    the dual clip (`dual_clip_c`); at sequence level for GSPO."""
    CISPO = "cispo"
    """CISPO (MiniMax-M1, 2025): the importance weight is clipped and detached, and multiplies
    A * log pi, so every token keeps a gradient (PPO's clip zeroes the gradient of clipped tokens)."""


def names() -> tuple[str, ...]:
    return tuple(str(p) for p in PolicyLoss)
