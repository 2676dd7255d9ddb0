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

from collections.abc import Callable
from typing import Literal

import torch

from slimrl import estimators
from slimrl.errors import ConfigError
from slimrl.estimators import Estimator
from slimrl.policy_losses import PolicyLoss

KLKind = Literal["k1", "k2", "k3", "low_var_kl"]
Level = Literal["token", "sequence"]
ISLevel = Literal["token", "sequence", "geometric"]
Reduction = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
GroupStd = Literal["unbiased", "population"]

_KL_KINDS = ("k1", "k2", "k3", "low_var_kl")
_LEVELS = ("token", "sequence")
_IS_LEVELS = ("token", "sequence", "geometric")
_REDUCTIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
_GROUP_STDS = ("unbiased", "population")

# Every importance ratio (policy, GSPO, TIS, MIS) clamps its log-ratio to [-20, 20] before exp, as
# does low_var_kl. Inside the bound values are untouched; beyond it exp would overflow fp32 near 88
# (inf loss, or 0 * inf = nan in the backward pass of a clip or a mask), and a ratio of e^20 ~ 4.9e8
# is already far outside any clip range, so only the gradient of such a token changes (to 0).
LOG_RATIO_BOUND = 20.0
_LOW_VAR_KL_LOG_RATIO_BOUND = LOG_RATIO_BOUND
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


def _group_std(rewards_GN: torch.Tensor, std: GroupStd | str) -> torch.Tensor:
    """Per-group std of the rewards, [G, 1]: `unbiased` (n - 1, Bessel) or `population` (n)."""
    _check_choice("algorithm.grpo_std", std, _GROUP_STDS)
    n = rewards_GN.shape[1]
    if std == "unbiased" and n < 2:  # no spread to estimate from one sample: 0, not 0/0 = nan
        return rewards_GN.new_zeros(rewards_GN.shape[0], 1)
    return rewards_GN.std(dim=1, keepdim=True, correction=1 if std == "unbiased" else 0)


def grpo_advantages(
    rewards_GN: torch.Tensor, normalize_std: bool, eps: float = 1e-6, *, std: GroupStd | str = "unbiased"
) -> torch.Tensor:
    """GRPO advantages per sample (Shao et al. 2024, DeepSeekMath, eq. 3); without the std division
    (`normalize_std=False`) the advantage half of Dr.GRPO (Liu et al. 2025).

    `std` picks the group std: `unbiased` (sum / (n - 1), what torch's `std()` gives and the GRPO
    implementations of TRL, verl, OpenRLHF and slime use) or `population` (sum / n). The default is
    unbiased so hyperparameters ported from those stacks mean the same here; the two differ by
    sqrt(n / (n - 1)) (1.07 at n = 8, 1.41 at n = 2). A group of one has advantage 0 either way.

    Also the advantages of GSPO: GSPO changes the importance ratio and clipping (sequence level in
    `policy_loss`), not the advantage estimator.
    """
    # A_ij = (r_ij - mean_j r_ij) / (std_j r_ij + eps)      [Dr.GRPO: A_ij = r_ij - mean_j r_ij]
    centred = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centred
    return centred / (_group_std(rewards_GN, std) + eps)


def rloo_advantages(rewards_GN: torch.Tensor) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): each sample's baseline is the mean reward of the
    other samples of its group. A group of one has no other sample: advantage 0."""
    # A_ij = r_ij - 1/(n-1) sum_{k != j} r_ik    (= n/(n-1) (r_ij - mean_j r_ij))
    n = rewards_GN.shape[1]
    if n < 2:
        return torch.zeros_like(rewards_GN)
    others = rewards_GN.sum(dim=1, keepdim=True) - rewards_GN
    return rewards_GN - others / (n - 1)


def reinforce_plus_plus_baseline_advantages(rewards_GN: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline, first half (Hu et al. 2025): the reward minus its group's mean.

    This centred score is what the driver sends; the trainer then treats it like REINFORCE++'s
    reward (last loss-masked token, optional KL penalty, returns) and whitens the result over the
    whole batch's loss tokens (`rl._token_level_advantages`, moments all-reduced over DP).
    """
    # s_ij = r_ij - mean_j r_ij
    return rewards_GN - rewards_GN.mean(dim=1, keepdim=True)


SAMPLE_SCORES: dict[Estimator, Callable[[torch.Tensor, bool, str], torch.Tensor]] = {
    # (rewards_GN, normalize_std, std) -> what the driver sends per sample (`sample_advantages`)
    Estimator.GRPO: lambda r, normalize, std: grpo_advantages(r, normalize, std=std),
    Estimator.GSPO: lambda r, normalize, std: grpo_advantages(r, normalize, std=std),  # GRPO's
    Estimator.RLOO: lambda r, _, __: rloo_advantages(r),
    Estimator.REINFORCE_PLUS_PLUS: lambda r, _, __: r.clone(),  # the trainer's returns
    Estimator.REINFORCE_PLUS_PLUS_BASELINE: lambda r, _, __: reinforce_plus_plus_baseline_advantages(r),
    Estimator.PPO: lambda r, _, __: r.clone(),  # the trainer's GAE
}
"""The driver's half of every estimator (`slimrl/estimators.py` names them; a test holds the two
tables to the same keys)."""


def sample_advantages(
    estimator: str, rewards_GN: torch.Tensor, normalize_std: bool, *, std: GroupStd | str = "unbiased"
) -> torch.Tensor:
    """Per-sample scalar for `algorithm.advantage_estimator`, broadcast to tokens by the caller.

    grpo/gspo/rloo return the final advantage. The token-level estimators return the score the
    trainer turns into advantages (`rl._token_level_advantages`): the raw reward for
    `reinforce_plus_plus` and `ppo`, the group-centred reward for `reinforce_plus_plus_baseline`.
    """
    _check_choice("algorithm.advantage_estimator", estimator, estimators.names())
    return SAMPLE_SCORES[Estimator(estimator)](rewards_GN, normalize_std, std)


def overlong_reward(
    response_lengths: torch.Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the task reward.

    With L_max = `max_len` and L_cache = `buffer_len` (times `penalty_factor`, 1 in the paper):
      R(|y|) = 0                                 |y| <= L_max - L_cache
               ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
               -1                                 L_max < |y|
    """
    if not 0 < buffer_len <= max_len:
        raise ConfigError(
            f"algorithm.overlong_buffer_len={buffer_len}: must be in 1..{max_len} "
            "(the maximum response length)"
        )
    lengths = response_lengths.to(torch.float64)
    expected = float(max_len - buffer_len)
    inside = (expected - lengths) / float(buffer_len)
    shaped = torch.where(lengths <= expected, torch.zeros_like(lengths), inside)
    shaped = torch.where(lengths > max_len, torch.full_like(lengths, -1.0), shaped)
    return shaped * penalty_factor


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
    # x is clamped to [-20, 20] before exp (LOG_RATIO_BOUND): finite value and gradient for any token.
    x = (-log_ratio).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if kind == "low_var_kl":
        return (torch.exp(x) - x - 1).clamp(-_LOW_VAR_KL_BOUND, _LOW_VAR_KL_BOUND)
    return torch.exp(x) - x - 1


def terminal_rewards(
    scores: torch.Tensor, mask_BS: torch.Tensor, kl_penalty_BS: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token rewards of REINFORCE++ / PPO, one sequence per row: each row's score on its last
    masked (loss) token, minus the per-token KL penalty on masked tokens only.

    Positions with mask 0 (prompt, padding, multi-turn tool/observation tokens) are not actions: they
    get neither the score nor a penalty. A row without masked tokens gets nothing.
    """
    # r_t = [t = last masked position] * score - m_t * kl_penalty_t
    mask = mask_BS.to(scores.dtype)
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).amax(dim=1)
    rewards = torch.zeros_like(mask)
    has = last >= 0
    rewards[has, last[has]] = scores[has]
    if kl_penalty_BS is not None:
        rewards = rewards - torch.where(mask > 0, kl_penalty_BS.to(rewards.dtype), 0.0) * mask
    return rewards


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
    # G_t = r_t + gamma * G_next(t): GAE's advantage with V = 0 and lambda = 1 (one implementation).
    zeros = torch.zeros_like(token_rewards_BS)
    return gae_vectorised(token_rewards_BS, zeros, mask_BS, gamma, 1.0, seq_index_BS)[0]


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


# Steps per block of `gae_vectorised`: one [sequences, 128] x [128, 128] product per block.
_GAE_BLOCK = 128


def gae_vectorised(
    token_rewards_BS: torch.Tensor,
    values_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    gamma: float,
    lambd: float,
    seq_index_BS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gae` without a Python loop over positions; the same values to rounding (tested against it).

    The masked steps of each sequence are gathered into one row of a [sequences, steps] layout,
    where the advantages are the deltas summed backwards with discount gamma*lambd: one matrix
    product per block of `_GAE_BLOCK` steps, plus the next block's first advantage carried in with
    its discount. The critic's training forward runs this per micro-batch; `gae`'s loop over a
    packed row of a few thousand positions cost a quarter of the critic's step on CPU.
    """
    # A_t = sum_{k >= 0} (gamma lambd)^k delta_{t+k}  (over the masked steps of t's sequence)
    #     = [block-local sum] + (gamma lambd)^(block end + 1 - t) A_{block end + 1}
    mask = _effective_mask(mask_BS, seq_index_BS)
    segments = _segment_ids(seq_index_BS, mask)
    with torch.no_grad():
        advantages = torch.zeros_like(values_BS)
        flat = (mask.reshape(-1) > 0).nonzero().squeeze(1)  # masked positions, in sequence order
        if flat.numel() == 0:
            return advantages, advantages.clone()
        # A sequence is one contiguous span of one row: its masked positions are consecutive here.
        _, row = torch.unique_consecutive(segments.reshape(-1)[flat], return_inverse=True)
        counts = torch.bincount(row)
        step = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(counts, 0) - counts)[row]
        width = -(-int(counts.max()) // _GAE_BLOCK) * _GAE_BLOCK
        rewards = values_BS.new_zeros(counts.numel(), width)
        values = values_BS.new_zeros(counts.numel(), width + 1)  # V after the last step = 0
        rewards[row, step] = token_rewards_BS.reshape(-1)[flat].to(values_BS.dtype)
        values[row, step] = values_BS.reshape(-1)[flat]
        delta = rewards + gamma * values[:, 1:] - values[:, :-1]  # 0 on the padding
        discount = gamma * lambd
        index = torch.arange(_GAE_BLOCK, device=values_BS.device)
        distance = index.unsqueeze(1) - index.unsqueeze(0)  # [k, t] = k - t
        weights = torch.where(distance >= 0, discount ** distance.clamp(min=0).to(values_BS.dtype), 0.0)
        carry_weight = discount ** (_GAE_BLOCK - index).to(values_BS.dtype)
        compact = torch.empty_like(delta)
        carry = delta.new_zeros(delta.shape[0], 1)
        for start in reversed(range(0, width, _GAE_BLOCK)):
            block = delta[:, start : start + _GAE_BLOCK] @ weights + carry_weight * carry
            compact[:, start : start + _GAE_BLOCK] = block
            carry = block[:, :1]
        advantages.view(-1)[flat] = compact[row, step]
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


def _masked(values_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    """`values` where the mask is set, 0 elsewhere, by selection: an inf or nan under a zero mask
    never reaches a sum (inf * 0 = nan) or the backward pass (where() sends those positions 0)."""
    return torch.where(mask_BS > 0, values_BS, 0.0)


def reduce_loss(
    loss_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    *,
    reduction: Reduction | str,
    global_tokens: float,
    global_seqs: float | None = None,
    seq_index_BS: torch.Tensor | None = None,
    norm_tokens: float | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the step loss, already divided by the global normaliser.

    token_mean:              sum_t m_t l_t / global_tokens
    seq_mean_token_mean:     sum_i (sum_{t in i} m_t l_t / n_i) / global_seqs,  n_i = sum_{t in i} m_t
    seq_mean_token_sum_norm: sum_i (sum_{t in i} m_t l_t / norm_tokens) / global_seqs   (Dr.GRPO: a
                             constant, the maximum response length, instead of each sequence's n_i)
    A sequence must lie whole in the micro-batch (n_i is counted locally; with context parallelism the
    caller would have to supply the full count). Sequences without masked tokens contribute 0.
    """
    _check_choice("algorithm.loss_reduction", reduction, _REDUCTIONS)
    mask = _effective_mask(mask_BS, seq_index_BS).to(loss_BS.dtype)
    if reduction == "token_mean":
        return _divide(_masked(loss_BS * mask, mask).sum(), global_tokens)
    if global_seqs is None:
        raise ValueError(f"reduction {reduction} needs global_seqs")
    if reduction == "seq_mean_token_sum_norm":
        if norm_tokens is None or norm_tokens <= 0:
            raise ValueError("reduction seq_mean_token_sum_norm needs norm_tokens > 0")
        return _divide(_masked(loss_BS * mask, mask).sum(), float(global_seqs) * float(norm_tokens))
    counts = _segment_sum(mask, _segment_ids(seq_index_BS, mask))
    return _divide(_masked(loss_BS * mask / counts.clamp(min=1.0), mask).sum(), global_seqs)


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


def _cispo_surrogate(
    ratio_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    logp_BS: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO's per-token loss (MiniMax-M1, 2025, eq. 4): -sg(clip(r, 1 - eps, 1 + eps_high)) A log pi.
    The weight is clipped and detached, so a clipped token still gets the gradient -w A d log pi
    (PPO's clip zeroes it); returns the loss and where the weight was clipped."""
    high = eps_clip if eps_clip_high is None else eps_clip_high
    weight = ratio_BS.detach().clamp(1.0 - eps_clip, 1.0 + high)
    clipped = (ratio_BS.detach() < 1.0 - eps_clip) | (ratio_BS.detach() > 1.0 + high)
    return -weight * advantages_BS * logp_BS, clipped


SURROGATES: tuple[PolicyLoss, ...] = (PolicyLoss.PPO_CLIP, PolicyLoss.CISPO)
"""The policy losses `policy_loss` computes (`slimrl/policy_losses.py` names them; a test holds the
two to the same members)."""


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
    norm_tokens: float | None = None,
    is_weights_BS: torch.Tensor | None = None,
    surrogate: PolicyLoss | str = PolicyLoss.PPO_CLIP,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss (PPO/GRPO/DAPO at token level, GSPO at sequence level), or with
    `surrogate="cispo"` CISPO's clipped importance weight (token level only).

    Returns (loss, stats): the loss is this micro-batch's sum divided by the global normaliser of
    `reduction` (see `reduce_loss`), so micro-batch losses add up to the step loss. Stats are local and
    detached: clipfrac and dual_clipfrac (fractions of masked tokens), ppo_kl (masked mean of
    old_logp - logp) and tokens (the local masked count, to weight the fractions when aggregating).
    `is_weights_BS` (train/rollout importance weights, e.g. `truncated_is_weights`) multiply the
    per-token loss and are never differentiated.

    GSPO (level `sequence`, Zheng et al. 2025) is defined as the mean over sequences of the
    sequence-level clipped objective, which is `seq_mean_token_mean` of a per-token loss that is
    constant over each sequence; any other reduction would weight sequences by their length, so it is
    refused. Log-ratios are clamped to +-LOG_RATIO_BOUND before exp, and positions outside the mask
    are replaced by 0 before any arithmetic: loss and gradient stay finite for any input.
    """
    _check_choice("level", level, _LEVELS)
    _check_choice("algorithm.policy_loss", surrogate, tuple(SURROGATES))
    if surrogate == PolicyLoss.CISPO and (level != "token" or dual_clip_c is not None):
        raise ConfigError("algorithm.policy_loss=cispo: token level only, without dual_clip_c")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ConfigError(f"algorithm.dual_clip_c={dual_clip_c}: must be > 1")
    if level == "sequence" and reduction != "seq_mean_token_mean":
        raise ConfigError(
            f"algorithm.loss_reduction={reduction}: GSPO (advantage_estimator=gspo) is the mean over "
            "sequences of the sequence objective; use loss_reduction=seq_mean_token_mean"
        )
    mask = _effective_mask(mask_BS, seq_index_BS)
    token_log_ratio = _masked(logp_BS - old_logp_BS, mask)  # r_t = exp(logp_t - old_logp_t)
    advantages = _masked(advantages_BS, mask)
    if level == "sequence":
        # GSPO: s_i = exp(mean_{t in i} (logp_t - old_logp_t)), with the per-token form
        # r_t = sg(s_i) * exp(logp_t - sg(logp_t)): value s_i, d r_t / d logp_t = s_i. For advantages
        # constant over the sequence, seq_mean_token_mean of this loss is exactly GSPO's objective
        # (1/G sum_i of the clipped s_i A_i) with its gradient, and clipping decides once per sequence
        # since r_t = s_i. (token_mean would weight sequence i by its length n_i: not GSPO.)
        seq_log_ratio = _segment_mean(token_log_ratio.detach(), mask, _segment_ids(seq_index_BS, mask))
        seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        log_ratio = seq_log_ratio + _masked(logp_BS - logp_BS.detach(), mask)
    else:
        log_ratio = token_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    if surrogate == PolicyLoss.CISPO:
        loss_BS, clip_active = _cispo_surrogate(
            ratio, advantages, _masked(logp_BS, mask), eps_clip, eps_clip_high
        )
        dual_active = torch.zeros_like(clip_active)
    else:
        loss_BS, clip_active, dual_active = _clipped_surrogate(
            ratio, advantages, eps_clip, eps_clip_high, dual_clip_c
        )
    if is_weights_BS is not None:
        loss_BS = loss_BS * _masked(is_weights_BS.detach(), mask)
    loss = reduce_loss(
        loss_BS,
        mask,
        reduction=reduction,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        seq_index_BS=seq_index_BS,
        norm_tokens=norm_tokens,
    )
    with torch.no_grad():
        tokens = mask.to(logp_BS.dtype).sum()
        stats = {
            "clipfrac": _masked_fraction(clip_active, mask),
            "dual_clipfrac": _masked_fraction(dual_active, mask),
            "ppo_kl": (-token_log_ratio * mask.to(logp_BS.dtype)).sum() / tokens.clamp(min=1.0),
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
    norm_tokens: float | None = None,
) -> torch.Tensor:
    """KL(pi || pi_ref) penalty for the loss (kl_loss_coef is applied by the caller), normalised sum
    under the same `reduction` as the policy loss."""
    # L = reduce(kl_estimate(logp, ref_logp, kind))
    mask = _effective_mask(mask_BS, seq_index_BS)
    return reduce_loss(
        kl_estimate(_masked(logp_BS, mask), _masked(ref_logp_BS, mask), kind),
        mask,
        reduction=reduction,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        seq_index_BS=seq_index_BS,
        norm_tokens=norm_tokens,
    )


def entropy_bonus(
    entropy_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    global_tokens: float,
    *,
    reduction: Reduction | str = "token_mean",
    global_seqs: float | None = None,
    seq_index_BS: torch.Tensor | None = None,
    norm_tokens: float | None = None,
) -> torch.Tensor:
    """Normalised entropy sum (positive) under the policy loss's `reduction`; the caller subtracts
    entropy_coef times it from the loss."""
    # H = reduce(entropy_t)
    return reduce_loss(
        _masked(entropy_BS, _effective_mask(mask_BS, seq_index_BS)),
        mask_BS,
        reduction=reduction,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        seq_index_BS=seq_index_BS,
        norm_tokens=norm_tokens,
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


def _is_log_ratio(
    train_logp_BS: torch.Tensor,
    rollout_logp_BS: torch.Tensor,
    mask_BS: torch.Tensor | None,
    level: ISLevel | str,
    seq_index_BS: torch.Tensor | None,
) -> torch.Tensor:
    """log rho per position, clamped to +-LOG_RATIO_BOUND: the token's own, or its sequence's
    (`sequence`: sum over the masked tokens, log of the product of ratios; `geometric`: their mean)."""
    log_ratio = train_logp_BS - rollout_logp_BS
    if mask_BS is None:
        if level != "token":
            raise ValueError(f"importance-sampling level {level} needs the loss mask")
        return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    mask = _effective_mask(mask_BS, seq_index_BS).to(log_ratio.dtype)
    log_ratio = _masked(log_ratio, mask)
    if level == "sequence":
        log_ratio = _segment_sum(log_ratio, _segment_ids(seq_index_BS, mask))
    elif level == "geometric":
        log_ratio = _segment_mean(log_ratio, mask, _segment_ids(seq_index_BS, mask))
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def truncated_is_weights(
    train_logp_BS: torch.Tensor,
    rollout_logp_BS: torch.Tensor,
    clip_low: float,
    clip_high: float,
    *,
    level: Level | str = "token",
    mask_BS: torch.Tensor | None = None,
    seq_index_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """Truncated importance weights pi_train / pi_rollout for the tokens the rollout engine sampled.

    `train_logp` is the trainer's logprob under the weights the engine used (the old logprobs), so the
    weight corrects only for the numerical/engine mismatch. Detached: it rescales, never steers.
    Level `token` weighs each token by its own ratio (Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"); `sequence` weighs every token of a sequence by the
    product of its masked tokens' ratios, the sequence's likelihood ratio (needs `mask_BS`).
    """
    # token:    w_t = clamp(exp(logp_train_t - logp_rollout_t), clip_low, clip_high)
    # sequence: w_i = clamp(exp(sum_{t in i} m_t (logp_train_t - logp_rollout_t)), clip_low, clip_high)
    _check_choice("algorithm.tis_level", level, _LEVELS)
    with torch.no_grad():
        log_ratio = _is_log_ratio(train_logp_BS, rollout_logp_BS, mask_BS, level, seq_index_BS)
        return torch.exp(log_ratio).clamp(clip_low, clip_high)


def masked_is(
    train_logp_BS: torch.Tensor,
    rollout_logp_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    low: float,
    high: float,
    level: ISLevel | str = "token",
    seq_index_BS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked importance sampling (rejection sampling): drop tokens (or whole sequences) whose ratio
    leaves [low, high].

    Levels: `token` (each token's ratio), `sequence` (the product of the sequence's token ratios),
    `geometric` (Geo-RS: their geometric mean, a per-token-normalised sequence ratio).
    Returns (new_mask_BS, dropped_fraction), the fraction of the originally masked local tokens that
    were dropped. Keep the step's global normaliser computed from the original mask: a dropped token
    then acts as importance weight 0 rather than silently rescaling the others.
    """
    # token:     rho_t = exp(logp_train_t - logp_rollout_t)
    # sequence:  rho_i = exp(sum_{t in i} (logp_train_t - logp_rollout_t))   (product of rho_t)
    # geometric: rho_i = exp(mean_{t in i} (logp_train_t - logp_rollout_t))  (geometric mean of rho_t)
    # keep iff low <= rho <= high
    _check_choice("algorithm.mis_level", level, _IS_LEVELS)
    with torch.no_grad():
        mask = _effective_mask(mask_BS, seq_index_BS)
        ratio = torch.exp(_is_log_ratio(train_logp_BS, rollout_logp_BS, mask, level, seq_index_BS))
        keep = (ratio >= low) & (ratio <= high)
        new_mask = mask * keep.to(mask.dtype)
        return new_mask, 1.0 - _masked_fraction(keep, mask)


__all__ = [
    "SAMPLE_SCORES",
    "SURROGATES",
    "entropy_bonus",
    "gae",
    "gae_vectorised",
    "grpo_advantages",
    "kl_estimate",
    "kl_loss",
    "logprob_mismatch_stats",
    "masked_is",
    "masked_moments",
    "mean_var_from_moments",
    "mismatch_metrics",
    "overlong_reward",
    "policy_loss",
    "reduce_loss",
    "reinforce_plus_plus_baseline_advantages",
    "reinforce_plus_plus_returns",
    "rloo_advantages",
    "sample_advantages",
    "terminal_rewards",
    "truncated_is_weights",
    "value_loss",
    "whiten",
]
