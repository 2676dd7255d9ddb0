"""Built-in dynamic-sampling filters (`rollout.dynamic_sampling_filter_path`).

A filter is `filter(config, group) -> bool` (or `(bool, reason)`): True keeps a finished group.
"""

from __future__ import annotations

import math

from slimrl.config.schema import SlimConfig
from slimrl.rollout.rewards import scalar_reward
from slimrl.sample import Sample


def nonzero_reward_std(config: SlimConfig, group: list[Sample]) -> tuple[bool, str]:
    """DAPO's dynamic sampling (Yu et al. 2025): drop groups whose rewards are all equal, as their
    GRPO advantages are all zero; with `rollout.dynamic_sampling_std_threshold` > 0, drop every group
    whose reward std (population) is at most the threshold."""
    rewards = [scalar_reward(s.reward) for s in group]
    threshold = config.rollout.dynamic_sampling_std_threshold
    if threshold <= 0:
        return len(set(rewards)) > 1, "zero_std"
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return std > threshold, "low_std"
