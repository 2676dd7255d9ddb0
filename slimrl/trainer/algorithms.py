"""RL algorithm math: advantage estimators, policy/value/KL losses, train/rollout mismatch corrections.

Everything here is a pure torch function on local tensors. Nothing calls torch.distributed or Megatron:
whatever needs a global view (the token count of the optimizer step, the batch mean and variance
for whitening) is computed by the caller, all-reduced there, and passed in. That keeps each formula
testable against a plain-Python reference and keeps the normalisation contract of `losses.py`: every
loss returns the micro-batch SUM already divided by a global normaliser, so the caller just adds
micro-batches and the result does not depend on how the step was cut up.

Conventions (shared with `batch.py`):
- `_BS` tensors are [batch rows, padded length] and aligned with the labels; masks are float 0/1.
- `seq_index_BS` gives the sequence each position belongs to (-1 for padding). A row may hold several
  packed sequences; each sequence occupies one contiguous span of one row, so only *changes* of the
  id along a row matter, not the id values. `None` means one sequence per row.
- `_GN` tensors are [prompt groups, samples per group] (`rewards.view(num_groups, n)`).
- Log-probabilities are natural-log probabilities of the sampled tokens.
"""

from __future__ import annotations

from typing import Literal

import torch

from slimrl.errors import ConfigError

KLKind = Literal["k1", "k2", "k3", "low_var_kl"]
Level = Literal["token", "sequence"]
Reduction = Literal["token_mean", "seq_mean_token_mean"]

_KL_KINDS = ("k1", "k2", "k3", "low_var_kl")
_LEVELS = ("token", "sequence")
_REDUCTIONS = ("token_mean", "seq_mean_token_mean")
_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")

# low_var_kl clamps the log-ratio to this range before exp. For |x| >= 20, k3 already exceeds the
# output clamp of 10 (k3(20) ~ 4.9e8, k3(-20) ~ 19), so values are unchanged; the inner clamp only
# keeps exp finite so the backward pass of the outer clamp is 0 instead of 0 * inf = nan.
_LOW_VAR_KL_LOG_RATIO_BOUND = 20.0
_LOW_VAR_KL_BOUND = 10.0


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(choices)}")


def _divide(total: torch.Tensor, normaliser: float) -> torch.Tensor:
    # An empty optimizer step has an all-zero mask, so its sum is 0; dividing by 1 keeps it 0, not nan
    # (the same guard as `losses.loss_scale`).
    return total / max(float(normaliser), 1.0)


# ---------------------------------------------------------------------------------------------------
# Sequence bookkeeping for packed rows
# ---------------------------------------------------------------------------------------------------


def _segment_ids(seq_index_BS: torch.Tensor | None, like_BS: torch.Tensor) -> torch.Tensor:
    """Flat position of the first position of each position's sequence: a dense-enough id in [0, B*S).

    Deriving ids from the layout (a new segment starts where the id changes along a row) means callers
    may keep whatever numbering they like, e.g. the original ids after splitting a batch into rows,
    and no data-dependent size (a device sync) is needed for the segment buffers.
    """
    rows, length = like_BS.shape
    device = like_BS.device
    if seq_index_BS is None:
        return (torch.arange(rows, device=device) * length).unsqueeze(1).expand(rows, length)
    flat_pos = torch.arange(rows * length, device=device).view(rows, length)
    starts = torch.ones_like(seq_index_BS, dtype=torch.bool)
    starts[:, 1:] = seq_index_BS[:, 1:] != seq_index_BS[:, :-1]
    # Every row starts a segment at flat position row*S, larger than anything in earlier rows, so a
    # running max over the flattened rows never leaks a segment across rows.
    marked = torch.where(starts, flat_pos, torch.zeros_like(flat_pos))
    return torch.cummax(marked.reshape(-1), dim=0).values.view(rows, length)


def _effective_mask(mask_BS: torch.Tensor, seq_index_BS: torch.Tensor | None) -> torch.Tensor:
    """Padding (seq id -1) never counts, even if a caller's mask says otherwise."""
    if seq_index_BS is None:
        return mask_BS
    return mask_BS * (seq_index_BS >= 0).to(mask_BS.dtype)


def _segment_sum(values_BS: torch.Tensor, segments_BS: torch.Tensor) -> torch.Tensor:
    """Sum of `values` over each position's segment, broadcast back to the positions.

    index_add is differentiable and deterministic on CUDA under torch.use_deterministic_algorithms.
    """
    flat = segments_BS.reshape(-1)
    sums = values_BS.new_zeros(flat.numel()).index_add(0, flat, values_BS.reshape(-1))
    return sums.gather(0, flat).view_as(values_BS)


def _segment_mean(values_BS: torch.Tensor, mask_BS: torch.Tensor, segments_BS: torch.Tensor) -> torch.Tensor:
    """Masked mean over each position's sequence (0 for a sequence without masked tokens)."""
    sums = _segment_sum(values_BS * mask_BS, segments_BS)
    counts = _segment_sum(mask_BS.to(values_BS.dtype), segments_BS)
    return sums / counts.clamp(min=1.0)


# ---------------------------------------------------------------------------------------------------
# 1. Sample-level advantage estimators (driver side)
# ---------------------------------------------------------------------------------------------------


def grpo_advantages(rewards_GN: torch.Tensor, normalize_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages per sample; Dr.GRPO (no std division) when `normalize_std` is False.

    Also the advantages of GSPO: GSPO changes the importance ratio and clipping (sequence level in
    `policy_loss`), not the advantage estimator.
    """
    # A_ij = (r_ij - mean_j r_ij) / (std_j r_ij + eps)      [Dr.GRPO: A_ij = r_ij - mean_j r_ij]
    # std is the population std (unbiased=False): the advantage is a z-score *within this group*,
    # not an estimate of some population variance, and n-1 would divide by zero for n = 1 groups
    # (the population std is 0 there, so the advantage is a clean 0).
    centred = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centred
    return centred / (rewards_GN.std(dim=1, keepdim=True, unbiased=False) + eps)


def reinforce_plus_plus_baseline_advantages(rewards_GN: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the group mean; the batch-level scaling comes later from `whiten`."""
    # A_ij = r_ij - mean_j r_ij
    return rewards_GN - rewards_GN.mean(dim=1, keepdim=True)


def sample_advantages(estimator: str, rewards_GN: torch.Tensor, normalize_std: bool) -> torch.Tensor:
    """Per-sample scalar for `algorithm.advantage_estimator`, broadcast to tokens by the caller.

    `reinforce_plus_plus` and `ppo` return the raw rewards: their token-level advantages come from
    `reinforce_plus_plus_returns` / `gae`, with the reward placed on the last response token.
    """
    _check_choice("algorithm.advantage_estimator", estimator, _ESTIMATORS)
    if estimator in ("grpo", "gspo"):  # GSPO shares GRPO's advantages
        return grpo_advantages(rewards_GN, normalize_std)
    if estimator == "reinforce_plus_plus_baseline":
        return reinforce_plus_plus_baseline_advantages(rewards_GN)
    return rewards_GN.clone()


# ---------------------------------------------------------------------------------------------------
# 2. Token-level estimators, returns, GAE, whitening
# ---------------------------------------------------------------------------------------------------


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind | str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (the policy of `logp`).

    k1 is unbiased but can be negative, k2 is biased with low variance, k3 is unbiased and >= 0
    (Schulman's estimators); low_var_kl is k3 clamped to [-10, 10] as in verl/slime.
    """
    _check_choice("algorithm.kl_estimator", kind, _KL_KINDS)
    log_ratio = logp - ref_logp  # log(pi / pi_ref)
    if kind == "k1":
        return log_ratio  # k1 = log pi - log pi_ref
    if kind == "k2":
        return 0.5 * log_ratio.square()  # k2 = 1/2 (log pi - log pi_ref)^2
    # k3 = exp(x) - x - 1 with x = log pi_ref - log pi  (E_pi[exp(x)] = 1, so unbiased)
    x = -log_ratio
    if kind == "low_var_kl":
        x = x.clamp(-_LOW_VAR_KL_LOG_RATIO_BOUND, _LOW_VAR_KL_LOG_RATIO_BOUND)
        return (torch.exp(x) - x - 1).clamp(-_LOW_VAR_KL_BOUND, _LOW_VAR_KL_BOUND)
    return torch.exp(x) - x - 1


def reinforce_plus_plus_returns(
    token_rewards_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    gamma: float,
    seq_index_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """Discounted return-to-go of each masked position within its sequence (0 elsewhere).

    `token_rewards_BS` holds the scalar reward on the last masked response token plus any per-token
    penalty (e.g. -kl_coef * kl). Only masked positions are time steps: unmasked positions inside a
    response (tool output in multi-turn samples) are environment tokens, not actions, so they neither
    receive a return nor add a discount step, and any reward placed on them is ignored.
    """
    # G_t = r_t + gamma * G_next(t), next(t) = next masked position of the same sequence, G after last = 0
    mask = _effective_mask(mask_BS, seq_index_BS)
    segments = _segment_ids(seq_index_BS, mask)
    with torch.no_grad():
        rows, length = mask.shape
        running = token_rewards_BS.new_zeros(rows)
        current = torch.full((rows,), -1, dtype=segments.dtype, device=segments.device)
        columns: list[torch.Tensor] = []
        for t in reversed(range(length)):
            active = mask[:, t] > 0
            carried = torch.where(segments[:, t] == current, running, torch.zeros_like(running))
            value = token_rewards_BS[:, t] + gamma * carried
            running = torch.where(active, value, running)
            current = torch.where(active, segments[:, t], current)
            columns.append(torch.where(active, value, torch.zeros_like(value)))
        return torch.stack(columns[::-1], dim=1)


def gae(
    token_rewards_BS: torch.Tensor,
    values_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    gamma: float,
    lambd: float,
    seq_index_BS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the masked positions of each sequence.

    Returns (advantages_BS, returns_BS), both 0 outside the mask. As in `reinforce_plus_plus_returns`,
    only masked positions are time steps, and the value after a sequence's last step is 0 (the
    episode ends there).
    """
    # delta_t = r_t + gamma * V_next(t) - V_t            (V after the last step = 0)
    # A_t     = delta_t + gamma * lambd * A_next(t)      (A after the last step = 0)
    # R_t     = A_t + V_t                                (the critic's regression target)
    mask = _effective_mask(mask_BS, seq_index_BS)
    segments = _segment_ids(seq_index_BS, mask)
    with torch.no_grad():
        rows, length = mask.shape
        next_value = values_BS.new_zeros(rows)
        next_adv = values_BS.new_zeros(rows)
        current = torch.full((rows,), -1, dtype=segments.dtype, device=segments.device)
        columns: list[torch.Tensor] = []
        for t in reversed(range(length)):
            active = mask[:, t] > 0
            same = segments[:, t] == current
            v_next = torch.where(same, next_value, torch.zeros_like(next_value))
            a_next = torch.where(same, next_adv, torch.zeros_like(next_adv))
            delta = token_rewards_BS[:, t] + gamma * v_next - values_BS[:, t]
            adv = delta + gamma * lambd * a_next
            next_value = torch.where(active, values_BS[:, t], next_value)
            next_adv = torch.where(active, adv, next_adv)
            current = torch.where(active, segments[:, t], current)
            columns.append(torch.where(active, adv, torch.zeros_like(adv)))
        advantages = torch.stack(columns[::-1], dim=1)
        returns = (advantages + values_BS) * mask.to(values_BS.dtype)
        return advantages, returns


def masked_moments(
    values_BS: torch.Tensor, mask_BS: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum, sum of squares, count) over masked positions, in float64, to be all-reduced by the caller.

    Sums (not means) are what add up across data-parallel ranks; float64 keeps
    var = E[x^2] - E[x]^2 free of cancellation for large token counts.
    """
    values = values_BS.detach().double()
    mask = mask_BS.detach().double()
    return (values * mask).sum(), (values.square() * mask).sum(), mask.sum()


def mean_var_from_moments(
    total: torch.Tensor, total_sq: torch.Tensor, count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population variance from (all-reduced) `masked_moments`."""
    # mean = S1 / n, var = S2 / n - mean^2 (population: n is the token count of the whole batch)
    n = count.clamp(min=1.0)
    mean = total / n
    return mean, (total_sq / n - mean.square()).clamp(min=0.0)


def whiten(
    values_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    mean: torch.Tensor | float,
    var: torch.Tensor | float,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Batch whitening with global statistics passed in (0 outside the mask)."""
    # w_t = (x_t - mean) / sqrt(var + eps)
    mean_t = torch.as_tensor(mean, dtype=values_BS.dtype, device=values_BS.device)
    var_t = torch.as_tensor(var, dtype=values_BS.dtype, device=values_BS.device)
    return (values_BS - mean_t) * torch.rsqrt(var_t + eps) * mask_BS.to(values_BS.dtype)


# ---------------------------------------------------------------------------------------------------
# 3. Losses
# ---------------------------------------------------------------------------------------------------


def reduce_loss(
    loss_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    *,
    reduction: Reduction | str,
    global_tokens: float,
    global_seqs: float | None = None,
    seq_index_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the step loss, already divided by the global normaliser.

    token_mean:          sum_t m_t l_t / global_tokens
    seq_mean_token_mean: sum_i (sum_{t in i} m_t l_t / n_i) / global_seqs,  n_i = sum_{t in i} m_t
    A sequence must lie whole in the micro-batch (n_i is counted locally; with context parallelism the
    caller would have to supply the full count). Sequences without masked tokens contribute 0.
    """
    _check_choice("algorithm.loss_reduction", reduction, _REDUCTIONS)
    mask = _effective_mask(mask_BS, seq_index_BS).to(loss_BS.dtype)
    if reduction == "token_mean":
        return _divide((loss_BS * mask).sum(), global_tokens)
    if global_seqs is None:
        raise ValueError("reduction seq_mean_token_mean needs global_seqs")
    counts = _segment_sum(mask, _segment_ids(seq_index_BS, mask))
    return _divide((loss_BS * mask / counts.clamp(min=1.0)).sum(), global_seqs)


def _masked_fraction(flag_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    # At least float32 (a bf16 count would be inexact beyond 256 tokens), float64 if the mask is.
    mask = mask_BS.detach().to(torch.promote_types(mask_BS.dtype, torch.float32))
    return (flag_BS.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1.0)


def _clipped_surrogate(
    ratio_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None,
    dual_clip_c: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO surrogate (to minimise) plus where the clip and the dual clip were active."""
    # pg = max(-A r, -A clip(r, 1 - eps, 1 + eps_high));  for A < 0: pg = min(pg, -A c)
    high = eps_clip if eps_clip_high is None else eps_clip_high
    unclipped = -advantages_BS * ratio_BS
    clipped = -advantages_BS * ratio_BS.clamp(1.0 - eps_clip, 1.0 + high)
    clip_active = clipped > unclipped
    # where() rather than maximum(): at ties maximum() splits the gradient between the branches.
    loss = torch.where(clip_active, clipped, unclipped)
    if dual_clip_c is None:
        return loss, clip_active, torch.zeros_like(clip_active)
    # Dual clip bounds the loss of a negative-advantage token whose ratio has exploded: without it,
    # -A r grows without limit (the clipped branch does not cap r from above when A < 0).
    cap = -advantages_BS * dual_clip_c
    dual_active = (advantages_BS < 0) & (cap < loss)
    return torch.where(dual_active, cap, loss), clip_active, dual_active


def policy_loss(
    logp_BS: torch.Tensor,
    old_logp_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    dual_clip_c: float | None = None,
    seq_index_BS: torch.Tensor | None = None,
    level: Level | str = "token",
    reduction: Reduction | str = "token_mean",
    global_tokens: float,
    global_seqs: float | None = None,
    is_weights_BS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss (PPO/GRPO/DAPO at token level, GSPO at sequence level).

    Returns (loss, stats): the loss is this micro-batch's sum divided by the global normaliser of
    `reduction` (see `reduce_loss`), so micro-batch losses add up to the step loss. Stats are local and
    detached: clipfrac and dual_clipfrac (fractions of masked tokens), ppo_kl (masked mean of
    old_logp - logp) and tokens (the local masked count, to weight the fractions when aggregating).
    `is_weights_BS` (train/rollout importance weights, e.g. `truncated_is_weights`) multiply the
    per-token loss and are never differentiated.
    """
    _check_choice("level", level, _LEVELS)
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ConfigError(f"algorithm.dual_clip_c={dual_clip_c}: must be > 1")
    mask = _effective_mask(mask_BS, seq_index_BS)
    log_ratio = logp_BS - old_logp_BS  # r_t = exp(logp_t - old_logp_t)
    if level == "sequence":
        # GSPO: s_i = exp(mean_{t in i} (logp_t - old_logp_t)), with the per-token form
        # r_t = sg(s_i) * exp(logp_t - sg(logp_t)): value s_i, d r_t / d logp_t = s_i. For advantages
        # constant over the sequence this gives exactly the gradient of GSPO's sequence objective
        # (under both reductions), while clipping decides once per sequence since r_t = s_i.
        seq_log_ratio = _segment_mean(log_ratio.detach(), mask, _segment_ids(seq_index_BS, mask))
        log_ratio = seq_log_ratio + logp_BS - logp_BS.detach()
    ratio = torch.exp(log_ratio)
    loss_BS, clip_active, dual_active = _clipped_surrogate(
        ratio, advantages_BS, eps_clip, eps_clip_high, dual_clip_c
    )
    if is_weights_BS is not None:
        loss_BS = loss_BS * is_weights_BS.detach()
    loss = reduce_loss(
        loss_BS,
        mask,
        reduction=reduction,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        seq_index_BS=seq_index_BS,
    )
    with torch.no_grad():
        tokens = mask.to(logp_BS.dtype).sum()
        stats = {
            "clipfrac": _masked_fraction(clip_active, mask),
            "dual_clipfrac": _masked_fraction(dual_active, mask),
            "ppo_kl": ((old_logp_BS - logp_BS) * mask.to(logp_BS.dtype)).sum() / tokens.clamp(min=1.0),
            "tokens": tokens,
        }
    return loss, {k: v.detach() for k, v in stats.items()}


def value_loss(
    values_BS: torch.Tensor,
    old_values_BS: torch.Tensor,
    returns_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    clip: float,
    global_tokens: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss of the PPO critic, token mean over the step; stats: value_clipfrac (local)."""
    # v_clip = old_v + clamp(v - old_v, -clip, clip)
    # l_t = 1/2 max((v - R)^2, (v_clip - R)^2)   (pessimistic, like the policy clip)
    v_clipped = old_values_BS + (values_BS - old_values_BS).clamp(-clip, clip)
    plain = (values_BS - returns_BS).square()
    clipped = (v_clipped - returns_BS).square()
    clip_active = clipped > plain
    loss_BS = 0.5 * torch.where(clip_active, clipped, plain)
    loss = _divide((loss_BS * mask_BS.to(loss_BS.dtype)).sum(), global_tokens)
    return loss, {"value_clipfrac": _masked_fraction(clip_active, mask_BS).detach()}


def kl_loss(
    logp_BS: torch.Tensor,
    ref_logp_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    kind: KLKind | str,
    global_tokens: float,
    *,
    reduction: Reduction | str = "token_mean",
    global_seqs: float | None = None,
    seq_index_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL(pi || pi_ref) penalty for the loss (kl_loss_coef is applied by the caller), normalised sum."""
    # L = reduce(kl_estimate(logp, ref_logp, kind))
    return reduce_loss(
        kl_estimate(logp_BS, ref_logp_BS, kind),
        mask_BS,
        reduction=reduction,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        seq_index_BS=seq_index_BS,
    )


def entropy_bonus(
    entropy_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    global_tokens: float,
    *,
    reduction: Reduction | str = "token_mean",
    global_seqs: float | None = None,
    seq_index_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalised entropy sum (positive); the caller subtracts entropy_coef times it from the loss."""
    # H = reduce(entropy_t)
    return reduce_loss(
        entropy_BS,
        mask_BS,
        reduction=reduction,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        seq_index_BS=seq_index_BS,
    )


# ---------------------------------------------------------------------------------------------------
# 4. Train/rollout mismatch: diagnostics and corrections
# ---------------------------------------------------------------------------------------------------


def logprob_mismatch_stats(
    train_logp_BS: torch.Tensor, rollout_logp_BS: torch.Tensor, mask_BS: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Sums for `train/train_rollout_logprob_abs_diff` and `train/train_rollout_kl` (all-reduce, divide).

    abs_diff_sum = sum_t m_t |logp_train - logp_rollout|
    kl_sum       = sum_t m_t k3_t, estimating KL(rollout || train): the tokens were sampled by the
    rollout policy mu, so with rho = pi_train / mu = exp(logp_train - logp_rollout),
    KL(mu || pi) = E_mu[-log rho] and E_mu[rho - 1] = 0, hence k3 = rho - log(rho) - 1 >= 0 is an
    unbiased, non-negative estimator. It is `kl_estimate(rollout, train, "k3")`.
    """
    with torch.no_grad():
        mask = mask_BS.double()
        diff = (train_logp_BS - rollout_logp_BS).double()
        k3 = kl_estimate(rollout_logp_BS.double(), train_logp_BS.double(), "k3")
        return {
            "abs_diff_sum": (diff.abs() * mask).sum(),
            "kl_sum": (k3 * mask).sum(),
            "tokens": mask.sum(),
        }


def mismatch_metrics(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Masked means from (all-reduced) `logprob_mismatch_stats` sums, under their logged names."""
    tokens = max(float(sums["tokens"]), 1.0)
    return {
        "train/train_rollout_logprob_abs_diff": float(sums["abs_diff_sum"]) / tokens,
        "train/train_rollout_kl": float(sums["kl_sum"]) / tokens,
    }


def truncated_is_weights(
    train_logp_BS: torch.Tensor, rollout_logp_BS: torch.Tensor, clip_low: float, clip_high: float
) -> torch.Tensor:
    """Truncated importance weights pi_train / pi_rollout for the tokens the rollout engine sampled.

    `train_logp` is the trainer's logprob under the weights the engine used (the old logprobs), so the
    weight corrects only for the numerical/engine mismatch. Detached: it rescales, never steers.
    """
    # w_t = clamp(exp(logp_train - logp_rollout), clip_low, clip_high)
    with torch.no_grad():
        return torch.exp(train_logp_BS - rollout_logp_BS).clamp(clip_low, clip_high)


def masked_is(
    train_logp_BS: torch.Tensor,
    rollout_logp_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    low: float,
    high: float,
    level: Level | str = "token",
    seq_index_BS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked importance sampling: drop tokens (or whole sequences) whose ratio leaves [low, high].

    Returns (new_mask_BS, dropped_fraction), the fraction of the originally masked local tokens that
    were dropped. Keep the step's global normaliser computed from the original mask: a dropped token
    then acts as importance weight 0 rather than silently rescaling the others.
    """
    # token:    rho_t = exp(logp_train_t - logp_rollout_t)
    # sequence: rho_i = exp(mean_{t in i} (logp_train_t - logp_rollout_t))  (geometric mean of rho_t)
    # keep iff low <= rho <= high
    _check_choice("algorithm.mis_level", level, _LEVELS)
    with torch.no_grad():
        mask = _effective_mask(mask_BS, seq_index_BS)
        log_ratio = train_logp_BS - rollout_logp_BS
        if level == "sequence":
            log_ratio = _segment_mean(log_ratio, mask.to(log_ratio.dtype), _segment_ids(seq_index_BS, mask))
        ratio = torch.exp(log_ratio)
        keep = (ratio >= low) & (ratio <= high)
        new_mask = mask * keep.to(mask.dtype)
        return new_mask, 1.0 - _masked_fraction(keep, mask)


__all__ = [
    "entropy_bonus",
    "gae",
    "grpo_advantages",
    "kl_estimate",
    "kl_loss",
    "logprob_mismatch_stats",
    "masked_is",
    "masked_moments",
    "mean_var_from_moments",
    "mismatch_metrics",
    "policy_loss",
    "reduce_loss",
    "reinforce_plus_plus_baseline_advantages",
    "reinforce_plus_plus_returns",
    "sample_advantages",
    "truncated_is_weights",
    "value_loss",
    "whiten",
]
