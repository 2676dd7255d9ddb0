"""The advantage estimators, by name, with what each needs from the rest of the run: the one list
the config gate, the driver and the trainer read (adding an estimator is one entry here and its
score function in `trainer/algorithms.py`, whose table a test holds to this one).

Torch-free and on the ground floor: the config gate checks names and combinations without
importing the trainer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class Estimator(StrEnum):
    GRPO = "grpo"
    GSPO = "gspo"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    PPO = "ppo"


@dataclass(frozen=True)
class Traits:
    group_baseline: bool
    """Its baseline is the other samples of the prompt: needs `rollout.n_samples_per_prompt >= 2`."""
    token_level: bool
    """The driver sends a per-sample score; the trainer turns it into per-token advantages (reward
    at the last token, optional KL penalty, returns or GAE, whitening over the batch)."""
    critic: bool = False
    """A value model is trained beside the policy (GAE's values)."""
    sequence_ratio: bool = False
    """The importance ratio is one per sequence (GSPO), not one per token."""
    std_choice: bool = False
    """`algorithm.normalize_std` applies (the group's reward std divides the advantage)."""


TRAITS: dict[Estimator, Traits] = {
    Estimator.GRPO: Traits(group_baseline=True, token_level=False, std_choice=True),
    Estimator.GSPO: Traits(group_baseline=True, token_level=False, sequence_ratio=True, std_choice=True),
    Estimator.RLOO: Traits(group_baseline=True, token_level=False),
    Estimator.REINFORCE_PLUS_PLUS: Traits(group_baseline=False, token_level=True),
    Estimator.REINFORCE_PLUS_PLUS_BASELINE: Traits(group_baseline=True, token_level=True),
    Estimator.PPO: Traits(group_baseline=False, token_level=True, critic=True),
}
assert set(TRAITS) == set(Estimator)


def traits(name: str) -> Traits:
    """The traits of the estimator named `name` (a checked config's `algorithm.advantage_estimator`)."""
    return TRAITS[Estimator(name)]


def names(predicate: Callable[[Traits], bool] = lambda _: True) -> tuple[str, ...]:
    """Names of the estimators whose traits satisfy `predicate`, in declaration order."""
    return tuple(str(e) for e, t in TRAITS.items() if predicate(t))
