"""Golden trajectories: a short GRPO run and a short PPO run (fixed seeds, the demo's configs cut
down) must write the per-step losses, rewards and norms in `tests/golden/trajectories.json`.

They pin behaviour across refactors (issue 23: moves of the trainer, the algorithms and the config
gate must not change a number). Each engine serves one request at a time (`max_concurrency=1`):
the embedded engine's batches otherwise change float rounding (~1e-6 in logprobs), which can flip
a sampled token and fork the trajectory. On the CPU model that wrote the file the numbers must be
equal bit for bit; elsewhere (another CPU's kernels round differently) within 1e-5 relative.

`SLIMRL_WRITE_GOLDEN=1 pytest tests/test_golden_trajectory.py` rewrites the file, for a change that
means to change the numbers (say which in its commit).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

GOLDEN = REPO / "tests" / "golden" / "trajectories.json"
STEPS = 3
KEYS = {
    "grpo": ("rollout/raw_reward", "train/pg_loss", "train/grad_norm", "train/entropy", "train/clipfrac"),
    "ppo": ("rollout/raw_reward", "train/pg_loss", "train/grad_norm", "train/value_loss", "train/values"),
}
CONFIGS = {"grpo": "tiny_moe_grpo_cpu.yaml", "ppo": "tiny_moe_ppo_cpu.yaml"}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def trajectory(tmp_path: Path, name: str, model: Path, data: Path) -> list[dict[str, float]]:
    cmd = [
        sys.executable, "-m", "slimrl.cli", "train", str(REPO / "configs" / CONFIGS[name]),
        f"model.hf_checkpoint={model}", f"data.prompt_data={data}", f"run.runs_dir={tmp_path}",
        f"run.name={name}", f"train.num_steps={STEPS}", "rollout.num_engines=1",
        # 256 samples a step: a random policy answers 1 in ~104 right, so each step has rewards to learn from
        "rollout.rollout_batch_size=32", "rollout.n_samples_per_prompt=8", "rollout.max_concurrency=1",
        *(["critic.warmup_steps=0"] if name == "ppo" else []),
        "checkpoint.save_interval=null", "logging.tensorboard=false", "train.lr_schedule.warmup_steps=1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [{key: row[key] for key in KEYS[name]} for row in rows]


@pytest.mark.parametrize("name", sorted(KEYS))
def test_a_short_run_writes_the_golden_numbers(tmp_path, tiny_model, mod_sum_data, name):
    got = trajectory(tmp_path, name, tiny_model("qwen3_moe"), mod_sum_data)
    assert len(got) == STEPS
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("SLIMRL_WRITE_GOLDEN") == "1":
        golden[name] = got
        golden["cpu"] = cpu_model()
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    assert name in golden, f"no golden {name} trajectory: SLIMRL_WRITE_GOLDEN=1 writes it"
    if golden["cpu"] == cpu_model():
        assert got == golden[name]
        return
    for step, (mine, theirs) in enumerate(zip(got, golden[name], strict=True), start=1):
        for key in KEYS[name]:
            assert math.isclose(mine[key], theirs[key], rel_tol=1e-5, abs_tol=1e-7), (step, key)
