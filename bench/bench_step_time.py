"""The step-time model (`slimrl plan --time`, docs/step_time.md) against every published step time,
and its CPU twin against a real run of the tiny GRPO demo.

    python bench/bench_step_time.py [--metrics RUN/metrics.jsonl] [--fit] [--no-cli]

1. The published rows (`slimrl/planning/step_time_anchors.py`): row, phase, published, predicted,
   ratio and status (calibration, checked, open, unchecked).
2. `--fit`: solve the seven fitted constants again from the calibration phases and print them beside
   the ones in `slimrl/planning/step_time.py` (needs scipy).
3. The CPU twin: this machine's single-thread fp32 matmul FLOP/s and warm memory-copy bandwidth
   (one thread: `make demo` runs every process with OMP_NUM_THREADS=1) stand for a GPU's peaks in
   the same model, which then predicts each phase of `configs/tiny_moe_grpo_cpu.yaml`. With
   `--metrics` (a run's metrics.jsonl; this script starts no run) it prints measured vs predicted,
   the median over the steps after the first ten.
4. The CLI's speed: `plan --time` and `plan --search` on configs/grpo_moe_256gpu.yaml (unless
   `--no-cli`), against the issue's 5 s and 60 s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gate import record

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slimrl.planning import step_time as st  # noqa: E402
from slimrl.planning.step_time_anchors import ANCHORS, rows  # noqa: E402

FITTED = (
    "MATMUL_EFFICIENCY",
    "HBM_EFFICIENCY",
    "DECODE_STEP_OVERHEAD_S",
    "MOE_LAYER_OVERHEAD_S",
    "WEIGHT_LOAD_BYTES_PER_S",
    "WEIGHT_LOAD_S_PER_TENSOR",
    "REALLOCATING_OFFLOAD_BYTES_PER_S",
)
TINY = "configs/tiny_moe_grpo_cpu.yaml"
TWIN_METRICS = {
    "generation": "rollout/seconds",
    "training": "perf/train_compute_seconds",
    "weight_sync": "perf/weight_sync_seconds",
    "step": "perf/step_seconds",
}
"""The model's phase -> the run's metric. `rollout/seconds` is the rollout as the manager timed it
(requests out, scored samples back); `perf/train_compute_seconds` the trainer ranks' own time
(logprob passes included)."""


def published_table() -> float:
    """Prints the table; returns the share of checked phases within 25% of the published figure."""
    print(f"{'row':<42}{'phase':<14}{'published':>10}{'predicted':>10}{'ratio':>7}  status")
    counts: dict[str, int] = {}
    inside = 0
    for anchor, phase, published, predicted, status in rows():
        ratio = predicted / published
        counts[status] = counts.get(status, 0) + 1
        inside += status == "checked" and abs(ratio - 1) <= 0.25
        print(f"{anchor.key:<42}{phase:<14}{published:>10.1f}{predicted:>10.1f}{ratio:>7.2f}  {status}")
    print(
        f"\n{sum(counts.values())} published phases: "
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        + f"; {inside} of {counts.get('checked', 0)} checked within 25%"
    )
    return inside / max(counts.get("checked", 0), 1)


def fit() -> None:
    """Solve the fitted constants from the calibration phases (Nelder-Mead on log ratios)."""
    import scipy.optimize

    from slimrl.planning.step_time_anchors import anchor_spec, predicted

    targets = [(a, anchor_spec(a), p, a.published[p]) for a in ANCHORS for p in a.calibration]
    start = [getattr(st, name) for name in FITTED]

    def loss(scales: list[float]) -> float:
        if min(scales) <= 0:
            return 1e9
        for name, base, scale in zip(FITTED, start, scales, strict=True):
            setattr(st, name, base * scale)
        if st.MATMUL_EFFICIENCY > 1 or st.HBM_EFFICIENCY > 1:
            return 1e9
        return sum(math.log(predicted(a, spec, p) / pub) ** 2 for a, spec, p, pub in targets)

    result = scipy.optimize.minimize(
        loss, [1.0] * len(FITTED), method="Nelder-Mead", options={"maxiter": 1500}
    )
    print(f"\n{'constant':<30}{'in step_time.py':>16}{'re-fitted':>12}   ({len(targets)} calibration phases)")
    for name, base, scale in zip(FITTED, start, result.x, strict=True):
        print(f"{name:<30}{base:>16.4g}{base * scale:>12.4g}")
        setattr(st, name, base)


# ---------------------------------------------------------------------------------- CPU twin
def measure_peaks(seconds: float = 1.0) -> tuple[float, float]:
    """(fp32 matmul FLOP/s, memory-copy bytes/s) of one thread, warm, best of several rounds."""
    import torch

    torch.set_num_threads(1)
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = 0.0
    for _ in range(3):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 3:
            torch.mm(a, b)
            count += 1
        flops = max(flops, 2 * n**3 * count / (time.perf_counter() - start))
    src = torch.empty(64 * 2**20 // 4)
    dst = torch.empty_like(src)
    copy = 0.0
    for _ in range(5):
        dst.copy_(src)
        start = time.perf_counter()
        dst.copy_(src)
        copy = max(copy, 2 * src.numel() * 4 / (time.perf_counter() - start))  # read + write
    return flops, copy


def tiny_config(metrics: Path | None, workdir: Path):
    """The demo's config: a run's own (beside its metrics.jsonl) when given, else the shipped one
    with a tiny model and data made here (config.json and prompts are all the model reads)."""
    from slimrl.preflight import load_config

    run_config = metrics.parent / "config.yaml" if metrics else None
    if run_config is not None and run_config.is_file():
        config = load_config(run_config, [])
        if Path(config.model.hf_checkpoint, "config.json").is_file():
            return config
    from slimrl.data.tiny_models import make_tiny
    from slimrl.data.toy_tasks import make_data

    model, data = workdir / "tiny_qwen3_moe", workdir / "mod_sum.jsonl"
    make_tiny("qwen3_moe", model)
    make_data("mod_sum", data, num_samples=64)
    return load_config(REPO / TINY, [f"model.hf_checkpoint={model}", f"data.prompt_data={data}"])


def cpu_twin(metrics: Path | None) -> None:
    from slimrl.planning.gpus import measured_cpu
    from slimrl.planning.step_time_spec import spec_from_config

    flops, copy = measure_peaks()
    print(f"\nCPU twin: one thread, fp32 matmul {flops / 1e9:.1f} GFLOP/s, warm copy {copy / 1e9:.1f} GB/s")
    with tempfile.TemporaryDirectory() as tmp:
        config = tiny_config(metrics, Path(tmp))
        prompts = [
            json.loads(line)["prompt"] for line in Path(config.data.prompt_data).read_text().splitlines()
        ]
        prompt_tokens = statistics.mean(len(p) for p in prompts)  # the tiny model's tokenizer: one per char
        spec = spec_from_config(config, measured_cpu(flops, copy, 1), prompt_tokens, 1.0)
        result = st.predict(spec)
    predicted = dict(result.phases, step=result.step)
    measured: dict[str, float] = {}
    if metrics is not None:
        steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        steps = steps[10:] or steps
        for phase, key in TWIN_METRICS.items():
            values = [s[key] for s in steps if key in s]
            if values:
                measured[phase] = statistics.median(values)
    print(f"{'phase':<20}{'predicted s':>13}{'measured s':>12}{'ratio':>8}")
    for phase in ("generation", "policy_logprobs", "reference_logprobs", "training", "weight_sync", "step"):
        if predicted.get(phase, 0) == 0 and phase not in measured:
            continue
        got = measured.get(phase)
        ratio = f"{predicted[phase] / got:.3f}" if got else "-"
        shown = f"{got:.3f}" if got is not None else "-"
        print(f"{phase:<20}{predicted[phase]:>13.4f}{shown:>12}{ratio:>8}")
    if not measured:
        print("(no --metrics: a run's metrics.jsonl gives the measured column, e.g. after `make demo`)")


def cli_speed() -> dict[str, float]:
    """Seconds of each CLI call as its limit over the time taken (above 1: within the limit)."""
    margins = {}
    env = dict(os.environ, PYTHONPATH=str(REPO))
    workload = ["--prompt-tokens", "200", "--response-tokens", "4000"]
    for what, args, limit in (
        ("plan --time", ["--time", *workload], 5),
        ("plan --search", ["--search", *workload], 60),
    ):
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "slimrl.cli", "plan", "configs/grpo_moe_256gpu.yaml", *args],
            cwd=REPO, env=env, check=True, capture_output=True,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        print(f"{what} on configs/grpo_moe_256gpu.yaml: {seconds:.1f} s (limit {limit} s)")
        margins[f"{what.split()[1].lstrip('-')}_limit_over_seconds"] = limit / seconds
    return margins


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", type=Path, default=None, help="metrics.jsonl of a tiny GRPO demo run")
    parser.add_argument("--fit", action="store_true", help="re-solve the fitted constants")
    parser.add_argument("--no-cli", action="store_true", help="skip timing the CLI")
    args = parser.parse_args()
    if args.metrics is not None and not args.metrics.is_file():
        parser.error(f"--metrics {args.metrics}: no such file")
    gated = {"checked_phases_within_25pct": published_table()}
    if args.fit:
        fit()
    cpu_twin(args.metrics)
    if not args.no_cli:
        print()
        gated |= cli_speed()
    record("step_time", gated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
