"""Router overhead: generated tokens/s through sglang-router vs. straight to the engines.

One fleet (`--engines` embedded engines plus the real sglang-router, as `slimrl rollout` starts it)
serves both modes in the same run, through the same `FleetClient`: `router` posts every request
to the router, `client_side` picks the least-loaded engine itself. Rounds alternate between the
modes so drift (other load on the machine, warm caches) hits both alike. Every request decodes
exactly `--max-new-tokens` greedy tokens (EOS ignored), so all rows count the same work.

    python bench/bench_router.py [--engines 2] [--requests 64] [--concurrency 16] [--rounds 3]

Prints a JSON table; `router_vs_client_side` is the ratio of the median tokens/s of the modes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gate import record

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slimrl.config.schema import SlimConfig  # noqa: E402
from slimrl.rollout.client import FleetClient  # noqa: E402
from slimrl.rollout.fleet import Fleet  # noqa: E402

MODES = ("router", "client_side")


def _prompts(n: int) -> list[list[int]]:
    """Prompts of 8..23 tokens made of printable-character ids of the char tokenizer."""
    return [[3 + (7 * i + 3 * j) % 90 for j in range(8 + i % 16)] for i in range(n)]


async def _tokens_per_s(
    client: FleetClient, prompts: list[list[int]], max_new: int, concurrency: int
) -> float:
    gate = asyncio.Semaphore(concurrency)
    params = {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}

    async def one(prompt: list[int]) -> int:
        async with gate:
            response = await client.generate(input_ids=prompt, sampling_params=params)
            return response["meta_info"]["completion_tokens"]

    try:
        await one(prompts[0])  # warm-up (connection pool, engine caches)
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        return tokens / (time.perf_counter() - start)
    finally:
        await client.close()


def _config(model_dir: Path, engines: int, policy: str) -> SlimConfig:
    config = SlimConfig()
    config.model.hf_checkpoint = str(model_dir)
    config.rollout.num_engines = engines
    config.rollout.router.enabled = True
    config.rollout.router.policy = policy
    return config


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="qwen3_moe")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policy", default="round_robin")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from slimrl.data.tiny_models import make_tiny

    prompts = _prompts(args.requests)
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny(args.arch, Path(tmp) / args.arch)
        with Fleet(
            _config(model_dir, args.engines, args.policy), str(model_dir), Path(tmp) / "logs"
        ) as fleet:
            assert fleet.client is not None
            clients = {"router": fleet.client, "client_side": FleetClient(fleet.client.engines)}
            for _ in range(args.rounds):
                for mode in MODES:
                    client = clients[mode]
                    tps = asyncio.run(_tokens_per_s(client, prompts, args.max_new_tokens, args.concurrency))
                    results[mode].append(tps)
            routed = fleet.client.requests_via_router
    medians = {mode: statistics.median(values) for mode, values in results.items()}
    table = {
        "arch": args.arch,
        "engines": args.engines,
        "policy": args.policy,
        "requests": args.requests,
        "max_new_tokens": args.max_new_tokens,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "rows": [
            {
                "mode": mode,
                "tokens_per_s_median": round(medians[mode], 1),
                "tokens_per_s_rounds": [round(v, 1) for v in results[mode]],
            }
            for mode in MODES
        ],
        "requests_through_router": routed,
        "router_vs_client_side": round(medians["router"] / medians["client_side"], 3),
    }
    print(json.dumps(table, indent=2))
    record("router", {"router_vs_client_side": table["router_vs_client_side"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
