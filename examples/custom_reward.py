"""A custom reward (set `rollout.custom_rm_path: examples.custom_reward.reward`).

Returns a dict: the trainer optimises `score`; the other keys are logged. Correct answers score 1,
and answers that end cleanly (no trailing junk before the end-of-turn token) earn a small bonus.
"""

from __future__ import annotations

from slimrl.config.schema import SlimConfig
from slimrl.data.toy_tasks import extract_answer
from slimrl.sample import Sample


async def reward(config: SlimConfig, sample: Sample) -> dict[str, float]:
    answer = extract_answer(sample.response)
    correct = float(answer == str(sample.label).strip())
    clean = float(sample.response.strip().endswith("<|im_end|>") and len(answer) == len(str(sample.label)))
    return {"score": correct + 0.1 * clean, "correct": correct, "clean_ending": clean}
