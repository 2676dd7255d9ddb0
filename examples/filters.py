"""Example filters.

* `rollout.dynamic_sampling_filter_path: examples.filters.informative_group` keeps a finished group
  only when it can teach something: its rewards differ (else every GRPO advantage is zero) and not
  every response ran into the length limit.
* `rollout.buffer_filter_path: examples.filters.oldest_first` continues the partial groups that
  have waited longest first, so no group goes stale in the partial-rollout buffer.

Both are plain (`def`) functions: the rollout calls them synchronously.
"""

from __future__ import annotations

import math

from slimrl.config.schema import SlimConfig
from slimrl.rollout.rewards import scalar_reward
from slimrl.sample import Sample, Status


def informative_group(config: SlimConfig, group: list[Sample]) -> tuple[bool, str]:
    """(keep?, reason): the reason names why a group was dropped."""
    if len({scalar_reward(s.reward) for s in group}) <= 1:
        return False, "zero_std"
    if all(s.status == Status.TRUNCATED for s in group):
        return False, "all_truncated"
    return True, ""


def oldest_first(config: SlimConfig, buffer: list[list[Sample]], n: int) -> list[list[Sample]]:
    """Up to `n` groups of the buffer, those first aborted in the earliest rollout first."""

    def started(group: list[Sample]) -> float:
        return min((s.metadata.get("start_rollout_id", math.inf) for s in group), default=math.inf)

    return sorted(buffer, key=started)[:n]
