"""PPO with GAE and a critic (Schulman et al. 2017; GAE: Schulman et al. 2016): one rollout's training.

Order per rollout batch (`train_rollout`):
1. Reference / old logprobs as for every estimator (`rl.prepare`; the old ones come from the
   training forward when `rl.fused_old_logprobs` allows).
2. Token rewards: the sample's reward on its last loss-masked token, minus `kl_coef * KL(old||ref)`
   on loss-masked tokens (`algorithms.terminal_rewards`).
3. Values V(s_t) of the critic, GAE advantages and returns with `gamma`/`lambd` over the loss-masked
   tokens (`algorithms.gae_vectorised`, equal to `algorithms.gae`), advantages whitened over the
   whole step (moments all-reduced over DP).
   With one optimizer step per rollout this happens inside the critic's training forward (its own
   values, detached, are the old values); otherwise a forward-only value pass comes first.
4. For each of `train.steps_per_rollout` slices: a critic step on the clipped value loss
   (`algorithms.value_loss`, `critic.value_clip`), then a policy step (`rl.policy_step`), except
   during the first `critic.warmup_steps` rollouts, in which only the critic trains.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from slimrl.trainer import algorithms as alg
from slimrl.trainer import rl

if TYPE_CHECKING:
    from slimrl.trainer.actor import MegatronActor
    from slimrl.trainer.batch import TrainBatch


def _rows(batch: TrainBatch, values: list[list[float]]) -> list[list[float]]:
    return [row[:n] for row, n in zip(values, batch.response_lengths, strict=True)]


def token_rewards(actor: MegatronActor, batch: TrainBatch) -> list[list[float]]:
    """Per response token: the score on the last loss-masked token, minus the KL penalty."""
    mask, _ = rl._padded([[float(m) for m in lm] for lm in batch.loss_masks])
    return _rows(batch, rl.terminal_token_rewards(actor, batch, mask).tolist())


def whiten_over_dp(
    actor: MegatronActor, batch: TrainBatch, advantages: list[list[float]]
) -> list[list[float]]:
    """(A - mean) / std over the loss-masked tokens of the whole step (all DP ranks)."""
    values, _ = rl._padded(advantages)
    mask, _ = rl._padded([[float(m) for m in lm] for lm in batch.loss_masks])
    total, total_sq, count = alg.masked_moments(values, mask)
    summed = actor.runner.sum_over_dp({"s": float(total), "sq": float(total_sq), "n": float(count)})
    mean, var = alg.mean_var_from_moments(
        torch.tensor(summed["s"], dtype=torch.float64),
        torch.tensor(summed["sq"], dtype=torch.float64),
        torch.tensor(summed["n"], dtype=torch.float64),
    )
    return _rows(batch, alg.whiten(values, mask, mean, var).tolist())


def _per_sample(batch: TrainBatch, captured: dict[int, list[float]]) -> list[list[float]]:
    """Captured per-sequence values in batch order (zeros where this rank has none)."""
    return [captured.get(i, [0.0] * n) for i, n in zip(batch.ids, batch.response_lengths, strict=True)]


def separate_value_pass(actor: MegatronActor, batch: TrainBatch) -> None:
    """Old values, GAE returns and whitened advantages before any update (steps_per_rollout > 1)."""
    assert actor.critic is not None
    algo = actor.config.algorithm
    values = _per_sample(batch, actor.critic.values(actor, batch))
    assert batch.per_token.token_rewards is not None
    rewards, _ = rl._padded(batch.per_token.token_rewards)
    old, _ = rl._padded(values)
    mask, _ = rl._padded([[float(m) for m in lm] for lm in batch.loss_masks])
    advantages, returns = alg.gae_vectorised(rewards, old, mask, algo.gamma, algo.lambd)
    batch.per_token.old_values = values
    batch.per_token.returns = _rows(batch, returns.tolist())
    batch.per_token.advantages = whiten_over_dp(actor, batch, _rows(batch, advantages.tolist()))


def in_warmup(actor: MegatronActor) -> bool:
    """The first `critic.warmup_steps` rollouts train the critic alone (`steps_done` counts this one)."""
    return actor.steps_done <= actor.config.critic.warmup_steps


def train_rollout(actor: MegatronActor, batch: TrainBatch) -> dict[str, float]:
    """Logprob passes, GAE on the critic's values, then critic and (after warm-up) policy steps."""
    assert actor.critic is not None
    start = time.perf_counter()
    metrics = rl.prepare(actor, batch)
    batch.per_token.token_rewards = token_rewards(actor, batch)
    steps = actor.config.train.steps_per_rollout
    fused = steps == 1
    if not fused:
        value_start = time.perf_counter()
        separate_value_pass(actor, batch)
        metrics["perf/value_seconds"] = time.perf_counter() - value_start
    warmup = in_warmup(actor)
    per_step = max(len(batch) // steps, 1)
    step_metrics: list[dict[str, float]] = []
    for step in range(steps):
        indices = list(range(step * per_step, min((step + 1) * per_step, len(batch))))
        if not indices:
            continue
        part = batch.select(indices)
        current, advantages = actor.critic.train_step(actor, part, fused)
        if fused:
            part.per_token.advantages = whiten_over_dp(actor, part, _per_sample(part, advantages))
        if not warmup:
            current.update(rl.policy_step(actor, part))
        step_metrics.append(current)
    for key in step_metrics[0]:
        metrics[key] = sum(m[key] for m in step_metrics) / len(step_metrics)
    metrics["train/critic_warmup"] = float(warmup)
    metrics["perf/train_seconds"] = time.perf_counter() - start
    return metrics
