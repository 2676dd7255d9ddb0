"""`make demo` whole, as a fresh clone runs it: the README's claim that it reaches a last-10 reward
of 0.9, measured. Its own module, so the two test workers can balance it against the rest."""

from __future__ import annotations

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from tests.conftest import REPO
from tests.test_rl_e2e import CONFIG, rows

pytestmark = pytest.mark.slow


@pytest.mark.timeout(2400)  # ~4 min alone; beside the other worker's runs, about twice that
def test_make_demo_reaches_the_readme_s_0_9(tmp_path):
    """`make demo`'s script on the demo config, whole (330 steps: EP2, 2 engines behind
    sglang-router, 64 prompts x 16 samples), from a missing model and data set as a fresh clone
    runs it (the script makes both, as `make demo` does): the README's claim, measured. It trains
    from chance, the mean of the last 10 rollouts reaches 0.9 (first at steps 231-278 in 10 runs of
    3 seeds, ended at 0.927-0.979), and the script reports the first-10 and last-10 reward, that
    step, its wall time and the plot."""
    cmd = [
        sys.executable, "launch/demo.py", f"model.hf_checkpoint={tmp_path / 'tiny_qwen3_moe'}",
        f"data.prompt_data={tmp_path / 'mod_sum_train.jsonl'}", f"run.runs_dir={tmp_path}",
        "checkpoint.save_interval=null", "logging.tensorboard=false",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=2300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    metrics = rows(tmp_path / "tiny_moe_grpo")
    steps = OmegaConf.load(CONFIG).train.num_steps  # the config as written (its model path is not here)
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))
    assert all(r["rollout/samples"] == 64 * 16 for r in metrics)
    reward = [r["rollout/raw_reward"] for r in metrics]
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    means = [sum(reward[i - 10 : i]) / 10 for i in range(10, steps + 1)]
    reached = next((i + 10 for i, mean in enumerate(means) if mean >= 0.9), None)
    assert first < 0.05 and reached is not None and last >= 0.9, (first, last, reached)
    assert f"first 10 rollouts {first:.3f}, last 10 rollouts {last:.3f} ({steps} steps)" in proc.stdout
    assert f"last-10 mean first >= 0.9 at step {reached}; wall time" in proc.stdout
    assert (tmp_path / "tiny_moe_grpo" / "reward_curve.png").stat().st_size > 0
