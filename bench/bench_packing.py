"""Packing efficiency of dynamic batching: real tokens / processed tokens on long-tailed lengths.

A rollout batch (prompts uniform in [--min-prompt, --max-prompt] tokens, responses lognormal with a
long tail, capped at --max-response) is split over `--dp` data-parallel ranks exactly as the
driver does (`split_for_dp`: equal sample counts, token-balanced) and cut into micro-batches under
`train.max_tokens_per_gpu` on each rank, three ways, with the trainer's own functions:

* `packed` (CPU local attention path): `split_by_tokens(packed=True)` + `collate_packed`: one row,
  no padding, block-diagonal mask;
* `padded_first_fit` (TE/GPU path): `split_by_tokens(packed=False)` + `collate`: one sequence per
  row, padded to the micro-batch's longest;
* `naive`: every sequence padded to the longest of the whole batch, as many per micro-batch as fit.

Processed tokens include the loss-free filler micro-batches that make every DP rank run the same
number of micro-batches (`pad_micro_batch_count`). Goal: packed >= 95%.

    python bench/bench_packing.py [--samples 512] [--dp 4] [--budget 8192]

Prints JSON; exits 1 if the packed efficiency is below `--min-efficiency`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Callable

from gate import record

from slimrl.sample import Sample
from slimrl.trainer.batch import (
    TrainBatch,
    collate,
    collate_packed,
    pad_micro_batch_count,
    split_by_tokens,
    split_fixed,
)


def make_samples(args: argparse.Namespace) -> list[Sample]:
    rng = random.Random(args.seed)
    samples = []
    for index in range(args.samples):
        prompt = rng.randint(args.min_prompt, args.max_prompt)
        response = max(1, min(args.max_response, int(rng.lognormvariate(args.mu, args.sigma))))
        samples.append(Sample(index=index, tokens=[5] * (prompt + response), response_length=response))
    return samples


def rank_batches(samples: list[Sample], dp: int) -> list[TrainBatch]:
    from slimrl.orchestration.train_data import split_for_dp

    return split_for_dp(samples, dp)


def evaluate(
    per_rank: list[TrainBatch], split: Callable[[TrainBatch], list[TrainBatch]], build, budget: int
) -> dict:
    """Cut every rank's batch, equalise micro-batch counts across ranks, count tokens.
    `budget_fill` = processed tokens / (micro-batches x budget): how full the micro-batches are."""
    parts = [split(batch) for batch in per_rank]
    count = max(len(p) for p in parts)
    processed = real = 0
    for rank_parts in parts:
        for part in pad_micro_batch_count(rank_parts, count):
            mb = build(part)
            processed += mb.num_tokens
            real += mb.real_tokens if part.ids != [-1] else 0
    return {
        "efficiency": round(real / processed, 4),
        "micro_batches_per_rank": count,
        "processed": processed,
        "budget_fill": round(processed / (count * len(per_rank) * budget), 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--budget", type=int, default=8192, help="train.max_tokens_per_gpu")
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--mu", type=float, default=5.8, help="lognormal response length: median e^mu")
    parser.add_argument("--sigma", type=float, default=0.9)
    parser.add_argument("--max-response", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-efficiency", type=float, default=0.95)
    args = parser.parse_args()

    samples = make_samples(args)
    per_rank = rank_batches(samples, args.dp)
    lengths = [len(s.tokens) for s in samples]
    longest = max(lengths)
    per_naive = max(args.budget // longest, 1)
    results = {
        "packed": evaluate(
            per_rank, lambda b: split_by_tokens(b, args.budget, packed=True), collate_packed, args.budget
        ),
        "padded_first_fit": evaluate(
            per_rank, lambda b: split_by_tokens(b, args.budget), collate, args.budget
        ),
        "naive": evaluate(
            per_rank,
            lambda b: split_fixed(b, per_naive),
            lambda p: collate(p, min_length=longest),
            args.budget,
        ),
    }
    report = {
        "samples": args.samples,
        "dp": args.dp,
        "max_tokens_per_gpu": args.budget,
        "real_tokens": sum(lengths),
        "sequence_length": {
            "median": statistics.median(lengths),
            "p95": sorted(lengths)[int(0.95 * len(lengths))],
            "max": longest,
        },
        "response_length": f"lognormal(mu={args.mu}, sigma={args.sigma}), capped at {args.max_response}",
        **results,
        "goal": f"packed efficiency >= {args.min_efficiency}",
    }
    print(json.dumps(report, indent=2))
    record("packing", {"packed_efficiency": results["packed"]["efficiency"]})
    return 0 if results["packed"]["efficiency"] >= args.min_efficiency else 1


if __name__ == "__main__":
    sys.exit(main())
