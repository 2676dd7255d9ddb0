"""Built-in dynamic-sampling filters (`rollout.dynamic_sampling_filter_path`).

A filter is `filter(config, group) -> bool` (or `(bool, reason)`): True keeps a finished group.
"""

from __future__ import annotations

from slimrl.config.schema import SlimConfig
from slimrl.rollout.rewards import scalar_reward
from slimrl.sample import Sample


def nonzero_reward_std(config: SlimConfig, group: list[Sample]) -> tuple[bool, str]:
    """Drop groups whose rewards are all equal: their GRPO advantages are all zero (DAPO)."""
    rewards = {scalar_reward(s.reward) for s in group}
    return len(rewards) > 1, "zero_std"
