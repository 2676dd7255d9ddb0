"""Group requests: the built-in rollout with each group as one batched `/generate`
(`rollout.group_requests`, the default) against one request per sample through sglang-router.

One fleet (`--engines` embedded engines behind the real sglang-router, as `slimrl train` starts
them; `--engine sglang` for real SGLang servers) serves both modes in the same run; rounds
alternate between them so other load on the machine hits both alike. Each round is one whole
rollout of `--prompts` x `--samples` on the mod-10 toy task (the demo's shape by default: one
answer token, so the per-request cost is all there is to see). Measured per mode: wall seconds and
the CPU seconds of every process involved (engines and their children, the router, this client),
per rollout and per sample. The tokens sampled are the same in both modes (each sample keeps its
seed; `tests/test_rollout.py` asserts it).

    python bench/bench_group_requests.py [--engine embedded|sglang] [--engines 2] [--prompts 64]
        [--samples 16] [--max-new-tokens 1] [--rounds 3]

Prints a JSON table; `single_vs_grouped_cpu` and `single_vs_grouped_wall` are the ratios of the
medians (how many times more the per-sample requests cost).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gate import record

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES = ("grouped", "single")


def _cpu_seconds(pids: list[int]) -> float:
    """CPU seconds so far of these processes and their children, plus this one's."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for process in [root, *root.children(recursive=True)]:
                times = process.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            pass
    own = resource.getrusage(resource.RUSAGE_SELF)
    return total + own.ru_utime + own.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", default="embedded", choices=["embedded", "sglang"])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from transformers import AutoTokenizer

    from slimrl.data.tiny_models import make_tiny
    from slimrl.data.toy_tasks import make_data
    from slimrl.preflight import load_config
    from slimrl.rollout.data_source import DataSource
    from slimrl.rollout.fleet import Fleet
    from slimrl.rollout.generate import RolloutContext
    from slimrl.rollout.rollout import run_rollout

    results: dict[str, dict[str, list[float]]] = {m: {"wall_s": [], "cpu_s": []} for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny("qwen3_moe", Path(tmp) / "qwen3_moe")
        data = make_data("mod_sum", Path(tmp) / "mod_sum.jsonl", num_samples=4096, seed=0)
        base = load_config(
            str(REPO / "configs" / "tiny_moe_grpo_cpu.yaml"),
            [
                f"model.hf_checkpoint={model_dir}", f"data.prompt_data={data}",
                f"rollout.engine={args.engine}", f"rollout.num_engines={args.engines}",
                f"rollout.rollout_batch_size={args.prompts}", f"rollout.n_samples_per_prompt={args.samples}",
                f"rollout.sampling.max_new_tokens={args.max_new_tokens}", "rollout.save_samples=false",
            ],
        )  # fmt: skip
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        with Fleet(base, str(model_dir), Path(tmp) / "logs") as fleet:
            assert fleet.client is not None
            pids = fleet.pids()  # every engine and the router
            configs = {}
            for mode in MODES:
                configs[mode] = copy.deepcopy(base)
                configs[mode].rollout.group_requests = mode == "grouped"
            for round_index in range(args.rounds + 1):  # round 0 warms both modes up
                for mode in MODES:
                    context = RolloutContext(configs[mode], tokenizer, fleet.client)
                    source = DataSource(configs[mode])

                    async def one(context: RolloutContext = context, source: DataSource = source) -> None:
                        try:
                            await run_rollout(context, source)
                        finally:
                            await context.client.close()

                    cpu, start = _cpu_seconds(pids), time.perf_counter()
                    asyncio.run(one())
                    wall, cpu = time.perf_counter() - start, _cpu_seconds(pids) - cpu
                    if round_index:
                        results[mode]["wall_s"].append(wall)
                        results[mode]["cpu_s"].append(cpu)
    samples = args.prompts * args.samples
    medians = {m: {k: statistics.median(v) for k, v in results[m].items()} for m in MODES}
    table = {
        "engine": args.engine,
        "engines": args.engines,
        "prompts": args.prompts,
        "samples_per_prompt": args.samples,
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "rows": [
            {
                "mode": mode,
                "wall_s_median": round(medians[mode]["wall_s"], 3),
                "cpu_s_median": round(medians[mode]["cpu_s"], 3),
                "cpu_ms_per_sample": round(1000 * medians[mode]["cpu_s"] / samples, 3),
                "wall_s_rounds": [round(v, 3) for v in results[mode]["wall_s"]],
            }
            for mode in MODES
        ],
        "single_vs_grouped_cpu": round(medians["single"]["cpu_s"] / medians["grouped"]["cpu_s"], 2),
        "single_vs_grouped_wall": round(medians["single"]["wall_s"] / medians["grouped"]["wall_s"], 2),
    }
    print(json.dumps(table, indent=2))
    record("group_requests", {k: table[k] for k in ("single_vs_grouped_cpu", "single_vs_grouped_wall")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
