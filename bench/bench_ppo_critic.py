"""PPO with a critic vs GRPO: one RL step of each on the same tokens, in one run.

One process, one `MegatronActor` (world size 1, gloo) on a freshly made tiny Qwen3-MoE with
`advantage_estimator: ppo`, so it holds the policy and the critic (a second model of the same shape
with a value head). The batch is `bench_trainer.py`'s (16 samples, long-tailed response lengths,
packed under `train.max_tokens_per_gpu`). Timed over `--repeats` rounds after a warm-up, PPO and
GRPO interleaved so both see the same machine load; the best round of each counts (the machine is
shared: contention only ever adds time), the medians are printed beside:

* `grpo_step`: `train_rl` with GRPO (the critic set aside): policy forward/backward + optimizer;
* `ppo_step`: `train_rl` with PPO: the critic's forward/backward with GAE on its own values
  (fused, one step per rollout), whitening, critic optimizer step, then the policy step;
* `critic_step`: the critic's step alone (`Critic.train_step`, fused);
* `value_pass`: the critic's forward-only value pass (what `steps_per_rollout > 1` adds).

`ppo_over_grpo` = ppo_step / grpo_step. The critic is one more model of the same size, so the goal
is about 2 (one more model's forward/backward, not more): exits 1 above `--max-ratio`. The PPO
step's own split (`ppo_critic_part`, `ppo_policy_part`) comes from its `perf/critic_seconds`.

    python bench/bench_ppo_critic.py [--samples 16] [--budget 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gate import record

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--budget", type=int, default=2048, help="train.max_tokens_per_gpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-ratio", type=float, default=2.2)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from bench_trainer import make_batch, tiny_actor

    from slimrl.trainer import ppo

    with tempfile.TemporaryDirectory() as tmp:
        actor = tiny_actor(tmp, args.budget, "algorithm.advantage_estimator=ppo", "critic.lr=1e-5")
        config = actor.config
        critic = actor.critic
        assert critic is not None
        base = make_batch(actor.arch.vocab_size, args.samples)
        # GRPO (a group estimator) gets advantages from the driver, PPO (token-level) the scores
        base.per_token.scores = [list(row) for row in base.per_token.advantages]
        rollout = actor.response_logprobs(base)
        base.per_token.rollout_logp = [rollout[i] for i in range(len(base))]

        def batch():  # every step gets a fresh copy: PPO writes its advantages into the batch
            return base.select(list(range(len(base))))

        def grpo_step() -> None:
            actor.critic, config.algorithm.advantage_estimator = None, "grpo"
            try:
                actor.train_rl(batch())
            finally:
                actor.critic, config.algorithm.advantage_estimator = critic, "ppo"

        def critic_step() -> None:
            part = batch()
            part.per_token.token_rewards = ppo.token_rewards(actor, part)
            critic.train_step(actor, part, fused=True)

        critic_parts: list[float] = []

        def ppo_step() -> None:
            critic_parts.append(actor.train_rl(batch())["perf/critic_seconds"])

        steps = {
            "grpo_step": grpo_step,
            "ppo_step": ppo_step,
            "critic_step": critic_step,
            "value_pass": lambda: critic.values(actor, batch()),
        }
        times: dict[str, list[float]] = {name: [] for name in steps}
        for fn in steps.values():  # warm-up
            fn()
        critic_parts.clear()
        for _ in range(args.repeats):
            for name, fn in steps.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    seconds = {name: min(values) for name, values in times.items()}
    best_ppo = times["ppo_step"].index(seconds["ppo_step"])
    seconds["ppo_critic_part"] = critic_parts[best_ppo]
    seconds["ppo_policy_part"] = seconds["ppo_step"] - critic_parts[best_ppo]
    ratio = seconds["ppo_step"] / seconds["grpo_step"]
    report = {
        "model": "tiny qwen3_moe (2 layers, 4 experts top-2, hidden 64); critic of the same shape",
        "samples": args.samples,
        "tokens": sum(len(t) for t in base.tokens),
        "response_tokens": sum(base.response_lengths),
        "max_tokens_per_gpu": args.budget,
        "threads": torch.get_num_threads(),
        "seconds": {name: round(value, 4) for name, value in seconds.items()},
        "median_seconds": {name: round(statistics.median(values), 4) for name, values in times.items()},
        "ppo_over_grpo": round(ratio, 3),
        "critic_step_over_grpo_step": round(seconds["critic_step"] / seconds["grpo_step"], 3),
        "goal": f"ppo_over_grpo <= {args.max_ratio} (one more model's forward/backward)",
        "goal_met": ratio <= args.max_ratio,
    }
    print(json.dumps(report, indent=2))
    record("ppo_critic", {"grpo_over_ppo_step": 1 / ratio})
    return 0 if report["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
