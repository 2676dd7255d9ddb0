"""`make demo`: GRPO on the tiny Qwen3-MoE with two embedded engines, learning a toy task by RL alone.

Builds the tiny model and data if missing, runs `slimrl train configs/tiny_moe_grpo_cpu.yaml`
(extra `key=value` arguments are passed on), then plots the reward curve and compares the mean
reward of the first and last 10 rollouts.
"""

import statistics
import sys
from pathlib import Path

from slimrl.cli import main
from slimrl.config import load_config
from slimrl.orchestration.metrics import read_metrics
from slimrl.utils.plot import plot_metric

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny_moe_grpo_cpu.yaml"


def run(argv: list[str]) -> None:
    print("$ slimrl " + " ".join(argv), flush=True)
    code = main(argv)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    data = ROOT / "data"
    if not (data / "tiny_qwen3_moe").exists():
        run(["make-tiny", "--arch", "qwen3_moe", "--out", str(data / "tiny_qwen3_moe")])
    if not (data / "mod_sum_train.jsonl").exists():
        run(["make-data", "--task", "mod_sum", "--out", str(data / "mod_sum_train.jsonl"), "--num", "2000"])
    # A fresh run every time (the config's checkpoints would otherwise resume a finished run).
    overrides = ["checkpoint.resume=false", *sys.argv[1:]]
    run(["train", str(CONFIG), *overrides])
    config = load_config(CONFIG, overrides)
    run_dir = Path(config.run.runs_dir) / config.run.name
    rewards = [row["rollout/raw_reward"] for row in read_metrics(run_dir / "metrics.jsonl")]
    curve = plot_metric(run_dir, run_dir / "reward_curve.png")
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    print(f"mean reward: first 10 rollouts {first:.3f}, last 10 rollouts {last:.3f} ({len(rewards)} steps)")
    print(f"reward curve: {curve}")
