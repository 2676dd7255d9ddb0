"""One rollout's worth of RL training on a Megatron rank: logprob passes, advantages, policy updates.

Order per rollout batch: reference logprobs (weights swapped in from host memory) when a KL term
needs them; old logprobs of the current policy (unless the rollout's are used, or the training
forward provides them, see `fused_old_logprobs`); per-token
advantages; then `train.steps_per_rollout` optimizer steps on equal slices of the batch. Values
that only the last pipeline stage can compute (logprobs) live on that stage, which is also where
every loss is computed.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from slimrl import estimators
from slimrl.trainer import algorithms as alg
from slimrl.trainer.batch import MicroBatch, PerToken, TrainBatch
from slimrl.trainer.logprobs import token_logprobs
from slimrl.trainer.step import token_means

if TYPE_CHECKING:
    from slimrl.config.schema import AlgorithmConfig, SlimConfig
    from slimrl.trainer.actor import MegatronActor

MISMATCH = "mismatch/"
"""Prefix of the train/rollout mismatch sums that the loss reports when old logprobs are fused."""


def sampling_temperature(actor: MegatronActor) -> float:
    """The rollout sampled from softmax(logits / T): score tokens under the same distribution."""
    temperature = actor.config.rollout.sampling.temperature
    return temperature if temperature > 0 else 1.0


def last_pipeline_stage() -> bool:
    """This rank holds the output layer (it computes losses and logprobs)."""
    from megatron.core import parallel_state as mpu

    return mpu.is_pipeline_last_stage(ignore_virtual=True)


def policy_logprobs(
    actor: MegatronActor, mb: MicroBatch, output: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs (and entropy) of the labels under the sampling temperature."""
    return token_logprobs(
        output,
        mb.labels_BS,
        true_vocab=actor.arch.vocab_size,
        temperature=sampling_temperature(actor),
        with_entropy=with_entropy,
        chunk_tokens=actor.config.train.logprob_chunk_tokens,
    )


def response_logprobs(actor: MegatronActor, batch: TrainBatch, with_entropy: bool = False) -> dict[str, Any]:
    """Forward-only pass: per-sample response-token logprobs (and entropy) on the last stage."""
    check_routing(actor, batch)

    def keep(mb: MicroBatch, output: torch.Tensor) -> dict[str, torch.Tensor]:
        logp, entropy = policy_logprobs(actor, mb, output, with_entropy)
        return {"logprobs": logp} if entropy is None else {"logprobs": logp, "entropy": entropy}

    kept = actor.runner.forward_only(batch, keep)
    return {"logprobs": kept.get("logprobs", {}), "entropy": kept.get("entropy", {})}


def _per_token(batch: TrainBatch, per_sample: dict[int, list[float]]) -> list[list[float]]:
    """Per-token values for every sequence (zeros where this rank has none: not the last stage)."""
    return [per_sample.get(i, [0.0] * batch.response_lengths[k]) for k, i in enumerate(batch.ids)]


def check_routing(actor: MegatronActor, batch: TrainBatch) -> None:
    """With routing replay, every sequence must carry the engine's routing for this model."""
    if actor.routing is not None and actor.routing.enabled:
        from slimrl.trainer.routing_replay import check_routing as check

        check(batch, actor.arch)


def prepare(actor: MegatronActor, batch: TrainBatch) -> dict[str, float]:
    """Logprob passes and advantages, before any optimizer step of this rollout.

    Under routing replay the reference model replays the engine's routing too: the KL term then
    compares the two models' outputs through the same experts (exactly 0 while their weights are
    equal), not top-k flips between two routers.
    """
    algo = actor.config.algorithm
    metrics: dict[str, float] = {}
    start = time.perf_counter()
    check_routing(actor, batch)
    needs_ref = algo.kl_loss_coef > 0 or algo.kl_coef > 0
    if needs_ref:
        with actor.weights.swapped_in("ref"):
            batch.per_token.ref_logp = _per_token(batch, response_logprobs(actor, batch)["logprobs"])
    if actor.routing is not None:  # count disagreement in the first forward under these weights
        actor.routing.measure_next = True
    if algo.use_rollout_logprobs:
        assert batch.per_token.rollout_logp is not None, "the driver sends the rollout logprobs"
        batch.per_token.old_logp = [list(v) for v in batch.per_token.rollout_logp]
    elif not fused_old_logprobs(actor.config):
        batch.per_token.old_logp = _per_token(batch, response_logprobs(actor, batch)["logprobs"])
        metrics.update(routing_disagreement(actor))
    if actor.routing is not None and algo.routing_replay_counterfactual:
        metrics.update(counterfactual_mismatch(actor, batch))
    metrics["perf/logprob_seconds"] = time.perf_counter() - start
    traits = estimators.traits(algo.advantage_estimator)
    if traits.token_level and not traits.critic:
        _token_level_advantages(actor, batch)  # with a critic: GAE on its values (`ppo.py`)
    if last_pipeline_stage() and batch.per_token.old_logp is not None:
        metrics.update(_mismatch(actor, batch))
    return metrics


def routing_disagreement(actor: MegatronActor) -> dict[str, float]:
    """`train/routing_disagreement`: the fraction of (input token, MoE layer) pairs of the measured
    pass whose engine top-k set differs from the trainer's own, over all ranks. A collective."""
    if actor.routing is None or not actor.routing.measure_next:
        return {}
    import torch.distributed as dist

    counts = actor.routing.take_disagreement()
    summed = torch.tensor([counts.disagree, counts.counted], dtype=torch.float64)
    dist.all_reduce(summed)  # tokens are split over DP and TP (SP), layers over PP: each counted once
    return {"train/routing_disagreement": float(summed[0] / summed[1].clamp(min=1.0))}


def counterfactual_mismatch(actor: MegatronActor, batch: TrainBatch) -> dict[str, float]:
    """The train/rollout mismatch metrics had the routers chosen for themselves (an extra forward),
    as `<metric>_no_replay`, on the last pipeline stage."""
    assert actor.routing is not None
    actor.routing.enabled = False
    try:
        free = response_logprobs(actor, batch)["logprobs"]
    finally:
        actor.routing.enabled = True
    if not last_pipeline_stage() or batch.per_token.rollout_logp is None:
        return {}
    scored = batch.select(list(range(len(batch))))
    scored.per_token.old_logp = _per_token(scored, free)
    scored.per_token.rollout_logp = batch.per_token.rollout_logp
    return {f"{k}_no_replay": v for k, v in _mismatch(actor, scored).items()}


def fused_old_logprobs(config: SlimConfig) -> bool:
    """With one optimizer step per rollout, the old policy is the policy being trained: the
    training forward's own logprobs, detached, serve as the old logprobs and the separate
    forward-only pass is skipped (ratio exactly 1, same gradient). Returns with a KL reward
    penalty need the old logprobs before training and keep the pass (PPO's GAE needs only the
    critic's values, see `ppo.py`)."""
    algo = config.algorithm
    return config.train.steps_per_rollout == 1 and not algo.use_rollout_logprobs and algo.kl_coef == 0


def _padded(values: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(v) for v in values), default=1)
    out = torch.zeros(len(values), width, dtype=torch.float64)
    mask = torch.zeros(len(values), width, dtype=torch.float64)
    for row, v in enumerate(values):
        out[row, : len(v)] = torch.tensor(v, dtype=torch.float64)
        mask[row, : len(v)] = 1.0
    return out, mask


def _mismatch(actor: MegatronActor, batch: TrainBatch) -> dict[str, float]:
    """train/train_rollout_logprob_abs_diff and train/train_rollout_kl over trained tokens."""
    old, rollout = batch.per_token.old_logp, batch.per_token.rollout_logp
    if old is None or rollout is None:
        return {}
    train_lp, _ = _padded(old)
    rollout_lp, _ = _padded(rollout)
    mask, _ = _padded([[float(m) for m in lm] for lm in batch.loss_masks])
    sums = alg.logprob_mismatch_stats(train_lp, rollout_lp, mask)
    reduced = actor.runner.sum_over_dp({k: float(v) for k, v in sums.items()})
    metrics = alg.mismatch_metrics({k: torch.tensor(v, dtype=torch.float64) for k, v in reduced.items()})
    return metrics | _mismatch_spread((train_lp - rollout_lp).abs()[mask > 0])


def _mismatch_spread(abs_diff: torch.Tensor) -> dict[str, float]:
    """Max |logp_train - logp_rollout| and the median probability ratio exp(|diff|) over the step's
    loss tokens on all DP ranks (a median needs them all: they are gathered)."""
    values = _gather_over_dp(abs_diff.double().reshape(-1))
    if not values.numel():
        return {}
    return {
        "train/train_rollout_logprob_abs_diff_max": float(values.max()),
        "train/train_rollout_prob_ratio_median": float(values.exp().quantile(0.5)),
    }


def _gather_over_dp(values: torch.Tensor) -> torch.Tensor:
    """This DP group's values, concatenated in rank order (unequal lengths allowed)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    group = mpu.get_data_parallel_group(with_context_parallel=True)
    size = dist.get_world_size(group)
    if size == 1:
        return values
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(size)]
    dist.all_gather(counts, torch.tensor([values.numel()]), group=group)
    longest = max(int(c) for c in counts)
    padded = torch.zeros(longest, dtype=values.dtype)
    padded[: values.numel()] = values
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[: int(c)] for part, c in zip(parts, counts, strict=True)])


def terminal_token_rewards(actor: MegatronActor, batch: TrainBatch, mask: torch.Tensor) -> torch.Tensor:
    """Per padded response token: the sample's score (`PerToken.scores`: raw reward, group-centred for the
    REINFORCE++ baseline) on its last loss-masked token, minus the per-token KL penalty when
    `algorithm.kl_coef` > 0. The token-level estimators' rewards (REINFORCE++ and PPO alike)."""
    algo = actor.config.algorithm
    kl_penalty = None
    if algo.kl_coef > 0:
        assert batch.per_token.old_logp is not None and batch.per_token.ref_logp is not None
        old, _ = _padded(batch.per_token.old_logp)
        ref, _ = _padded(batch.per_token.ref_logp)
        kl_penalty = algo.kl_coef * alg.kl_estimate(old, ref, algo.kl_estimator)
    assert batch.per_token.scores is not None, "a token-level estimator's driver sends scores"
    scores = torch.tensor([s[0] if s else 0.0 for s in batch.per_token.scores], dtype=torch.float64)
    return alg.terminal_rewards(scores, mask, kl_penalty)


def _token_level_advantages(actor: MegatronActor, batch: TrainBatch) -> None:
    """REINFORCE++ and REINFORCE++-baseline (Hu et al. 2025): discounted returns of (final score -
    per-token KL penalty) over the loss-masked tokens, whitened over the whole batch's loss tokens
    (moments all-reduced over DP). The baseline's score is the group-centred reward."""
    algo = actor.config.algorithm
    # Time steps are the loss-masked tokens: prompt, padding and multi-turn tool/observation tokens
    # (loss mask 0) are not actions, so they get no reward, no KL penalty, no return and stay out of
    # the whitening statistics; the score sits on the last loss-masked token.
    mask, _ = _padded([[float(m) for m in lm] for lm in batch.loss_masks])
    rewards = terminal_token_rewards(actor, batch, mask)
    returns = alg.reinforce_plus_plus_returns(rewards, mask, algo.gamma)
    total, total_sq, count = alg.masked_moments(returns, mask)
    summed = actor.runner.sum_over_dp({"s": float(total), "sq": float(total_sq), "n": float(count)})
    f64 = torch.float64  # the moments are float64 sums; a default float32 tensor would round them
    mean, var = alg.mean_var_from_moments(
        torch.tensor(summed["s"], dtype=f64),
        torch.tensor(summed["sq"], dtype=f64),
        torch.tensor(summed["n"], dtype=f64),
    )
    advantages = alg.whiten(returns, mask, mean, var)
    batch.per_token.advantages = [
        advantages[row, :n].tolist() for row, n in enumerate(batch.response_lengths)
    ]


def loss_normaliser_tokens(config: SlimConfig) -> float:
    """The constant of `loss_reduction: seq_mean_token_sum_norm` (Dr.GRPO): `algorithm.loss_norm_tokens`,
    else the maximum response length `rollout.sampling.max_new_tokens`."""
    norm = config.algorithm.loss_norm_tokens
    return float(norm if norm is not None else config.rollout.sampling.max_new_tokens)


def step_counts(loss_masks: list[list[int]]) -> dict[str, float]:
    """This rank's share of the step's normalisers: loss tokens, and sequences with at least one loss
    token (a sample whose mask is all zero, e.g. `Sample.remove_sample` or overlong filtering, is out
    of training and does not dilute the sequence mean)."""
    return {
        "tokens": float(sum(sum(m) for m in loss_masks)),
        "seqs": float(sum(1 for m in loss_masks if any(m))),
    }


def rl_loss(
    algo: AlgorithmConfig,
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    per_token: PerToken[torch.Tensor],
    *,
    global_tokens: float,
    global_seqs: float,
    norm_tokens: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's RL loss (its share of the step loss) and its report sums.

    Policy loss, KL loss and entropy bonus all use `algorithm.loss_reduction` with the step's global
    normalisers, so micro-batch losses add up to the step loss whatever the cut.
    """
    mask = loss_mask
    report: dict[str, torch.Tensor] = {}
    is_weights = None
    rollout_lp = per_token.rollout_logp
    old = per_token.old_logp
    if old is None:  # fused_old_logprobs: this forward runs the old policy
        old = logp.detach()
        if rollout_lp is not None:
            stats = alg.logprob_mismatch_stats(old, rollout_lp, mask)
            report.update({f"{MISMATCH}{k}": v for k, v in stats.items()})
    if algo.tis and rollout_lp is not None:
        is_weights = alg.truncated_is_weights(
            old,
            rollout_lp,
            algo.tis_clip_low,
            algo.tis_clip_high,
            level=algo.tis_level,
            mask_BS=mask,
            seq_index_BS=seq_index,
        )
        report["tis_weight_sum"] = (is_weights * mask).sum().detach()
    if algo.mis and rollout_lp is not None:
        mask, dropped = alg.masked_is(
            old, rollout_lp, mask, algo.mis_low, algo.mis_high, algo.mis_level, seq_index
        )
        report["mis_dropped_sum"] = dropped.detach() * loss_mask.sum()
    reduce: dict[str, Any] = {
        "reduction": algo.loss_reduction,
        "global_seqs": global_seqs,
        "seq_index_BS": seq_index,
        "norm_tokens": norm_tokens,
    }
    pg, stats = alg.policy_loss(
        logp,
        old,
        per_token.advantages,
        mask,
        eps_clip=algo.eps_clip,
        eps_clip_high=algo.eps_clip_high,
        dual_clip_c=algo.dual_clip_c,
        level="sequence" if estimators.traits(algo.advantage_estimator).sequence_ratio else "token",
        global_tokens=global_tokens,
        is_weights_BS=is_weights,
        surrogate=algo.policy_loss,
        **reduce,
    )
    loss = pg
    report["pg_loss"] = pg.detach()
    tokens = stats["tokens"]
    report["tokens"] = tokens.detach()
    report["clipfrac_sum"] = (stats["clipfrac"] * tokens).detach()
    report["ppo_kl_sum"] = (stats["ppo_kl"] * tokens).detach()
    if algo.kl_loss_coef > 0:
        kl = alg.kl_loss(logp, per_token.ref_logp, mask, algo.kl_estimator, global_tokens, **reduce)
        loss = loss + algo.kl_loss_coef * kl
        report["kl_loss"] = kl.detach()
    if entropy is not None:
        bonus = alg.entropy_bonus(entropy, mask, global_tokens, **reduce)
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * bonus
        report["entropy"] = bonus.detach()
    return loss, report


def policy_step(actor: MegatronActor, batch: TrainBatch) -> dict[str, float]:
    """One optimizer step on `batch` with the configured policy loss."""
    algo = actor.config.algorithm
    state = actor.state
    assert state is not None
    global_counts = actor.runner.sum_over_dp(step_counts(batch.loss_masks))
    norm_tokens = loss_normaliser_tokens(actor.config)
    need_entropy = True  # entropy is reported every step, whether or not it is in the loss
    fused_diffs: dict[int, list[float]] = {}
    """|old - rollout| per loss token when old logprobs are fused, by sample (a retry overwrites)."""

    def loss_fn(mb: MicroBatch, output: torch.Tensor, megatron_scale: int):
        logp, entropy = policy_logprobs(actor, mb, output, need_entropy)
        rollout_lp = mb.per_token_BS.rollout_logp
        if mb.per_token_BS.old_logp is None and rollout_lp is not None:
            diff = torch.where(mb.loss_mask_BS > 0, (logp.detach() - rollout_lp).abs(), float("nan"))
            fused_diffs.update(mb.per_sequence(diff))
        loss, report = rl_loss(
            algo,
            logp,
            entropy,
            mb.loss_mask_BS,
            mb.seq_index_BS,
            mb.per_token_BS,
            global_tokens=global_counts["tokens"],
            global_seqs=global_counts["seqs"],
            norm_tokens=norm_tokens,
        )
        return loss * megatron_scale, {k: v.detach().clone() for k, v in report.items()}

    result = actor.runner.optimizer_step(batch, actor.runner.megatron_scaled(loss_fn), with_labels=False)
    metrics = {
        "train/update_ok": float(result.applied),  # skipped: gradients not finite (trainer/numerics.py)
        "train/skipped_steps": float(actor.runner.skipped_steps),
        "train/grad_norm": result.grad_norm,
        "train/lr": state.optimizer.param_groups[0]["lr"],
        "train/oom_retries": float(actor.runner.oom_retries),
    }
    metrics.update(routing_disagreement(actor))  # when this was the measured forward
    if last_pipeline_stage():
        summed = actor.runner.summed_reports(result.reports)
        mismatch = {
            key.removeprefix(MISMATCH): torch.tensor(summed.pop(key), dtype=torch.float64)
            for key in sorted(summed)
            if key.startswith(MISMATCH)
        }
        if mismatch:
            metrics.update(alg.mismatch_metrics(mismatch))
            diffs = [v for values in fused_diffs.values() for v in values if v == v]  # v == v: not nan
            metrics.update(_mismatch_spread(torch.tensor(diffs, dtype=torch.float64)))
        metrics.update(token_means(summed, "train/"))
    return metrics


def train_rollout(actor: MegatronActor, batch: TrainBatch) -> dict[str, float]:
    """prepare() then `steps_per_rollout` optimizer steps on equal slices of the batch."""
    start = time.perf_counter()
    metrics = prepare(actor, batch)
    steps = actor.config.train.steps_per_rollout
    per_step = max(len(batch) // steps, 1)
    step_metrics: list[dict[str, float]] = []
    for step in range(steps):
        indices = list(range(step * per_step, min((step + 1) * per_step, len(batch))))
        if indices:
            step_metrics.append(policy_step(actor, batch.select(indices)))
    for key in {k for m in step_metrics for k in m}:  # the routing disagreement is the first step's
        values = [m[key] for m in step_metrics if key in m]
        metrics[key] = sum(values) / len(values)
    metrics["perf/train_seconds"] = time.perf_counter() - start
    return metrics
