"""The RL loop on the tiny MoE, measured in one run of this script:

1. Orchestration overhead of the `make demo` configuration (colocated, two training ranks, two
   engines behind sglang-router): the share of step time that is neither generation (the rollout
   as the rollout manager times it) nor training (the trainer ranks' own time). Goal < 10%.
2. Async overlap: one training rank and one engine on separate slots, with rollout and training of
   similar cost; the mean step time with `algorithm.async_staleness=1` vs. the synchronous loop.
   Goal <= 0.7x.
3. What the run's checks cost (issue 22), from the demo run: the update check (`perf/verify_seconds`)
   as a share of the weight sync, and the sampled-token checks (`check_sampled` on every sample and
   the driver's and the trainer's digests, timed here over the very samples the run saved in
   `rollout_samples.jsonl`) as a share of the step. Goals: <= 3% and <= 1%.

The first steps (start-up, first-touch) are left out of every mean.

    python bench/bench_rl_loop.py [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from gate import record

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "tiny_moe_grpo_cpu.yaml"
WARMUP = 3


def run(runs_dir: Path, name: str, steps: int, *overrides: str) -> list[dict]:
    cmd = [
        sys.executable, "-m", "slimrl.cli", "train", str(CONFIG), f"run.runs_dir={runs_dir}",
        f"run.name={name}", f"train.num_steps={steps}", "checkpoint.save_interval=null",
        "logging.tensorboard=false", *overrides,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
    path = runs_dir / name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()][WARMUP:]


def token_check_seconds(run_dir: Path) -> dict[int, float]:
    """Per rollout of the run: seconds of `check_sampled` on each sample plus two digests of it
    (the driver's and the trainer rank's), over the samples the run saved."""
    import time

    from slimrl.sample import Sample
    from slimrl.sampled import check_sampled, train_digest

    by_rollout: dict[int, list[Sample]] = {}
    for line in (run_dir / "rollout_samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        skip = ("rollout_id", "split", "rollout_routed_experts")  # routing is saved as its shape only
        sample = Sample.from_dict({k: v for k, v in record.items() if k not in skip})
        by_rollout.setdefault(record["rollout_id"], []).append(sample)
    seconds = {}
    for rollout, samples in by_rollout.items():
        start = time.perf_counter()
        for sample in samples:
            check_sampled(sample, "bench")
            for _ in range(2):
                train_digest(sample.tokens, sample.train_loss_mask(), None)
        seconds[rollout] = time.perf_counter() - start
    return seconds


def mean(rows: list[dict], key: str) -> float:
    return statistics.mean(r[key] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    assets = [f"model.hf_checkpoint={REPO / 'data' / 'tiny_qwen3_moe'}"]
    if not (REPO / "data" / "tiny_qwen3_moe").exists():
        sys.exit("run `make demo` once first (it builds data/tiny_qwen3_moe and the prompt data)")
    # Rollout and training of similar cost on separate slots (one core each): 64 answers of up to
    # 32 tokens, at most 8 in flight, cost the engine about what one update costs the trainer.
    disaggregated = [
        "cluster.colocate=false", "cluster.rollout_gpus=1", "rollout.num_engines=1", "parallel.ep=1",
        "rollout.rollout_batch_size=8", "rollout.sampling.max_new_tokens=32", "rollout.max_concurrency=8",
        # The demo's own 16 samples per prompt and padded micro-batches make training ~10x cheaper
        # than this rollout; packed micro-batches and 8 samples keep the two of similar cost.
        "rollout.n_samples_per_prompt=8", "train.max_tokens_per_gpu=4096",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp)
        demo = run(runs, "demo", args.steps, *assets)
        checks = token_check_seconds(runs / "demo")
        sync = run(runs, "sync", args.steps, *assets, *disaggregated, "algorithm.async_staleness=0")
        overlapped = run(runs, "async", args.steps, *assets, *disaggregated, "algorithm.async_staleness=1")
    step = mean(demo, "perf/step_seconds")
    report = {
        "demo_step_seconds": round(step, 3),
        "demo_generation_share": round(mean(demo, "rollout/seconds") / step, 3),
        "demo_training_share": round(mean(demo, "perf/train_compute_seconds") / step, 3),
        "demo_weight_sync_share": round(mean(demo, "perf/weight_sync_seconds") / step, 3),
        "demo_orchestration_overhead": round(mean(demo, "perf/overhead_ratio"), 3),
        "demo_verify_share_of_sync": round(
            mean(demo, "perf/verify_seconds") / mean(demo, "perf/weight_sync_seconds"), 3
        ),
        "demo_token_check_share_of_step": round(
            statistics.mean(checks[r["step"] - 1] / r["perf/step_seconds"] for r in demo), 4
        ),
        "sync_step_seconds": round(mean(sync, "perf/step_seconds"), 3),
        "sync_generation_seconds": round(mean(sync, "rollout/seconds"), 3),
        "sync_training_seconds": round(mean(sync, "perf/train_compute_seconds"), 3),
        "async_step_seconds": round(mean(overlapped, "perf/step_seconds"), 3),
        "async_vs_sync_step_time": round(
            mean(overlapped, "perf/step_seconds") / mean(sync, "perf/step_seconds"), 3
        ),
    }
    print(json.dumps(report, indent=1))
    record("rl_loop", {"demo_work_share": 1 - report["demo_orchestration_overhead"],
                       "sync_over_async_step": 1 / report["async_vs_sync_step_time"]})  # fmt: skip


if __name__ == "__main__":
    main()
