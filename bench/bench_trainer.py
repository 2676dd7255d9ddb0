"""RL trainer overhead: one RL training step vs. the bare Megatron step on the same tokens.

One process, one `MegatronActor` (world size 1, gloo) on a freshly made tiny Qwen3-MoE, one batch
of prompt + response sequences with long-tailed response lengths, packed under
`train.max_tokens_per_gpu`. Timed, each the median of `--repeats` runs after a warm-up:

* `bare_step`: `MegatronActor.train_step`: forward, cross-entropy on the response tokens,
  backward, optimizer step: the Megatron work any trainer does on these tokens;
* `rl_step`: `MegatronActor.train_rl` as configured by default (one optimizer step per rollout):
  per-token advantages, the clipped policy loss with entropy, backward, optimizer step, the old
  logprobs taken from the training forward itself (`rl.fused_old_logprobs`);
* `rl_step_separate_old_logprobs`: the same with the old logprobs recomputed by a forward-only pass
  first (what `train.steps_per_rollout > 1` needs);
* `rl_step_rollout_logprobs`: `train_rl` with `algorithm.use_rollout_logprobs=true`;
* `logprob_pass`: the forward-only pass alone (`response_logprobs`).

`overhead` = rl_step / bare_step - 1 (goal < 0.2); `overhead_separate_old_logprobs` is the same for
the recompute variant, a whole extra forward.

    python bench/bench_trainer.py [--samples 16] [--budget 2048] [--repeats 5]

Prints JSON; exits 1 if `overhead` is not below `--max-overhead`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gate import record

os.environ.setdefault("OMP_NUM_THREADS", "1")


def tiny_actor(tmp: str, budget: int, *overrides: str):
    """A one-rank Megatron actor on a fresh tiny Qwen3-MoE (fixed seed), set up for 1000 steps."""
    from slimrl.data.tiny_models import make_tiny
    from slimrl.preflight import load_config
    from slimrl.trainer.actor import MegatronActor
    from slimrl.trainer.distributed import RankInfo
    from slimrl.utils.net import free_port

    model = Path(tmp) / "qwen3_moe"
    make_tiny("qwen3_moe", model, seed=0)
    base = [f"model.hf_checkpoint={model}", "cluster.gpus_per_node=1", f"train.max_tokens_per_gpu={budget}"]
    config = load_config(None, [*base, "train.optimizer.lr=1e-5", *overrides])
    actor = MegatronActor(
        config, RankInfo(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
    )
    actor.setup(total_steps=1000)
    return actor


def make_batch(vocab: int, samples: int, seed: int = 0):
    """Prompts of 32..96 tokens, responses lognormal around 100 tokens (capped at 512)."""
    from slimrl.trainer.batch import PerToken, TrainBatch

    rng = random.Random(seed)
    tokens, responses = [], []
    for _ in range(samples):
        prompt = rng.randrange(32, 96)
        response = max(8, min(512, int(rng.lognormvariate(4.4, 0.6))))
        tokens.append([rng.randrange(3, vocab) for _ in range(prompt + response)])
        responses.append(response)
    return TrainBatch(
        tokens=tokens,
        response_lengths=responses,
        loss_masks=[[1] * n for n in responses],
        per_token=PerToken(advantages=[[rng.choice([-1.0, 1.0])] * n for n in responses]),
        global_num_tokens=sum(responses),
        global_num_seqs=samples,
    )


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--budget", type=int, default=2048, help="train.max_tokens_per_gpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-overhead", type=float, default=0.2)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from slimrl.trainer import rl as rl_module

    with tempfile.TemporaryDirectory() as tmp:
        actor = tiny_actor(tmp, args.budget)
        config = actor.config
        batch = make_batch(actor.arch.vocab_size, args.samples)
        rollout = actor.response_logprobs(batch)
        batch.per_token.rollout_logp = [rollout[i] for i in range(len(batch))]
        algo = config.algorithm

        def rl_with_rollout_logprobs() -> object:
            algo.use_rollout_logprobs = True
            try:
                return actor.train_rl(batch)
            finally:
                algo.use_rollout_logprobs = False

        def rl_with_separate_pass() -> object:
            fused, rl_module.fused_old_logprobs = rl_module.fused_old_logprobs, lambda config: False
            try:
                return actor.train_rl(batch)
            finally:
                rl_module.fused_old_logprobs = fused

        bare = median_seconds(lambda: actor.train_step(batch), args.repeats)
        rl = median_seconds(lambda: actor.train_rl(batch), args.repeats)
        rl_separate = median_seconds(rl_with_separate_pass, args.repeats)
        rl_no_recompute = median_seconds(rl_with_rollout_logprobs, args.repeats)
        logprob = median_seconds(lambda: actor.response_logprobs(batch), args.repeats)
    real = sum(len(t) for t in batch.tokens)
    report = {
        "model": "tiny qwen3_moe (2 layers, 4 experts top-2, hidden 64)",
        "samples": args.samples,
        "tokens": real,
        "response_tokens": sum(batch.response_lengths),
        "max_tokens_per_gpu": args.budget,
        "threads": torch.get_num_threads(),
        "seconds": {
            "bare_step": round(bare, 4),
            "rl_step": round(rl, 4),
            "rl_step_separate_old_logprobs": round(rl_separate, 4),
            "rl_step_rollout_logprobs": round(rl_no_recompute, 4),
            "logprob_pass": round(logprob, 4),
        },
        "overhead": round(rl / bare - 1, 4),
        "overhead_separate_old_logprobs": round(rl_separate / bare - 1, 4),
        "overhead_rollout_logprobs": round(rl_no_recompute / bare - 1, 4),
        "overhead_separate_beyond_extra_forward": round(rl_separate / (bare + logprob) - 1, 4),
        "goal": f"overhead < {args.max_overhead}",
        "goal_met": rl / bare - 1 < args.max_overhead,
    }
    print(json.dumps(report, indent=2))
    record(
        "trainer",
        {"bare_over_rl_step": bare / rl, "bare_over_rl_step_rollout_logprobs": bare / rl_no_recompute},
    )
    return 0 if report["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
