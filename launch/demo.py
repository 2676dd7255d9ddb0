"""`make demo`: GRPO on the tiny Qwen3-MoE with two embedded engines, learning a toy task by RL alone.

Builds the tiny model and data if missing, runs `slimrl train configs/tiny_moe_grpo_cpu.yaml`
(extra `key=value` arguments are passed on), then plots the reward curve and compares the mean
reward of the first and last 10 rollouts, with the step where the trailing 10-step mean first
reached 0.9 and the wall time of the whole command.
"""

import statistics
import sys
import time
from pathlib import Path

from slimrl.cli import main
from slimrl.orchestration.metrics import read_metrics
from slimrl.preflight import load_config
from slimrl.utils.plot import moving_average, plot_metric

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny_moe_grpo_cpu.yaml"
TARGET = 0.9


def run(argv: list[str]) -> None:
    print("$ slimrl " + " ".join(argv), flush=True)
    code = main(argv)
    if code:
        sys.exit(code)


def setting(overrides: list[str], key: str) -> str:
    """`key` as the command line sets it, else as the demo config does (before the model and data
    exist, which loading the config checks)."""
    from omegaconf import OmegaConf

    for item in reversed(overrides):
        if item.startswith(f"{key}="):
            return item.split("=", 1)[1]
    return str(OmegaConf.select(OmegaConf.load(CONFIG), key))


def first_reaching(rewards: list[float], target: float, window: int = 10) -> int | None:
    """The first step whose trailing `window`-step mean reward is at least `target`."""
    means = moving_average(rewards, window)
    return next((i + 1 for i, m in enumerate(means) if i + 1 >= window and m >= target), None)


if __name__ == "__main__":
    start = time.monotonic()
    # A fresh run every time: the config's checkpoints would otherwise resume a finished run, and
    # an earlier demo's are replaced (once this run's first checkpoint is complete).
    overrides = ["checkpoint.resume=false", "checkpoint.overwrite=true", *sys.argv[1:]]
    model = Path(setting(overrides, "model.hf_checkpoint"))
    data = Path(setting(overrides, "data.prompt_data"))
    if not model.exists():
        run(["make-tiny", "--arch", "qwen3_moe", "--out", str(model)])
    if not data.exists():
        run(["make-data", "--task", "mod_sum", "--out", str(data), "--num", "2000"])
    run(["train", str(CONFIG), *overrides])
    config = load_config(CONFIG, overrides)
    run_dir = Path(config.run.runs_dir) / config.run.name
    rewards = [row["rollout/raw_reward"] for row in read_metrics(run_dir / "metrics.jsonl")]
    curve = plot_metric(run_dir, run_dir / "reward_curve.png")
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    reached = first_reaching(rewards, TARGET)
    print(f"mean reward: first 10 rollouts {first:.3f}, last 10 rollouts {last:.3f} ({len(rewards)} steps)")
    print(
        f"last-10 mean first >= {TARGET} at step {reached if reached else '- (not reached)'}; "
        f"wall time {time.monotonic() - start:.0f} s"
    )
    print(f"reward curve: {curve}")
