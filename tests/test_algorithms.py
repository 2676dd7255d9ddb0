"""RL algorithm math against plain-Python float64 references that loop over groups, sequences and tokens.

Every batch has padding, prompt positions (mask 0), masked-out response tokens and rows packing two
sequences, so the sequence bookkeeping of GSPO, seq_mean_token_mean, returns and GAE is exercised.
"""

from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from slimrl.config.schema import SlimConfig
from slimrl.errors import ConfigError
from slimrl.orchestration.rl_loop import sample_advantages, train_batches
from slimrl.rollout import filters
from slimrl.sample import Sample, Status
from slimrl.trainer import algorithms as alg
from slimrl.trainer import rl
from slimrl.trainer.batch import PerToken

F64 = torch.float64
SEEDS = [0, 1, 2, 3]
Grid = list[list[float]]


def _t(x: Grid | list[float]) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def _grid(x: torch.Tensor) -> Grid:
    return [[float(v) for v in row] for row in x.tolist()]


# ---------------------------------------------------------------------------------------------------
# Random packed batches
# ---------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    ids: list[list[int]]
    mask: Grid
    logp: Grid
    old_logp: Grid
    adv_token: Grid
    adv_seq: Grid
    weights: Grid

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.ids), len(self.ids[0])

    def sequences(self) -> list[list[tuple[int, int]]]:
        return _ref_sequences(self.ids)

    def global_tokens(self) -> float:
        return sum(sum(row) for row in self.mask)

    def global_seqs(self) -> float:
        return float(len(self.sequences()))

    def rows(self, lo: int, hi: int) -> Batch:
        return Batch(*(getattr(self, f)[lo:hi] for f in Batch.__dataclass_fields__))


def _make_batch(seed: int, *, rows: int = 6, length: int = 16, spread: float = 0.4) -> Batch:
    rng = random.Random(seed)
    ids: list[list[int]] = []
    mask: Grid = []
    next_id = 0
    for r in range(rows):
        row_ids: list[int] = []
        row_mask: list[float] = []
        for _ in range(2 if r % 2 == 0 else 1):  # even rows pack two sequences
            prompt, response = rng.randint(1, 2), rng.randint(2, 5)
            row_ids += [next_id] * (prompt + response)
            row_mask += [0.0] * prompt + [float(rng.random() > 0.15) for _ in range(response)]
            next_id += 1
        if r == rows - 1:  # one row without padding, whose last sequence runs to the end
            extra = length - len(row_ids)
            row_ids += [next_id - 1] * extra
            row_mask += [1.0] * extra
        row_ids += [-1] * (length - len(row_ids))
        row_mask += [0.0] * (length - len(row_mask))
        ids.append(row_ids)
        mask.append(row_mask)
    logp = [[-rng.uniform(0.05, 3.0) for _ in range(length)] for _ in range(rows)]
    old_logp = [[lp + rng.gauss(0.0, spread) for lp in row] for row in logp]
    adv_token = [[rng.gauss(0.0, 1.0) for _ in range(length)] for _ in range(rows)]
    adv_seq = [[0.0] * length for _ in range(rows)]
    for seq in _ref_sequences(ids):
        a = rng.gauss(0.0, 1.0)
        for r, t in seq:
            adv_seq[r][t] = a
    weights = [[rng.uniform(0.5, 1.5) for _ in range(length)] for _ in range(rows)]
    return Batch(ids, mask, logp, old_logp, adv_token, adv_seq, weights)


def _ref_sequences(ids: list[list[int]] | None, shape: tuple[int, int] | None = None) -> list:
    """Positions of each sequence: a new one starts wherever the id changes along a row (-1 = none)."""
    if ids is None:
        assert shape is not None
        return [[(r, t) for t in range(shape[1])] for r in range(shape[0])]
    seqs: list[list[tuple[int, int]]] = []
    for r, row in enumerate(ids):
        previous = None
        for t, sid in enumerate(row):
            if sid != previous and sid >= 0:
                seqs.append([])
            if sid >= 0:
                seqs[-1].append((r, t))
            previous = sid
    return seqs


# ---------------------------------------------------------------------------------------------------
# Plain-Python references
# ---------------------------------------------------------------------------------------------------


def _ref_clip(ratio: float, a: float, eps: float, eps_high: float, c: float | None) -> tuple[float, str]:
    unclipped = -a * ratio
    clipped = -a * min(max(ratio, 1.0 - eps), 1.0 + eps_high)
    loss, case = (clipped, "clip") if clipped > unclipped else (unclipped, "none")
    if c is not None and a < 0 and -a * c < loss:
        loss, case = -a * c, "dual"
    return loss, case


NORM_TOKENS = 7.0  # the constant of seq_mean_token_sum_norm in these tests


def _ref_reduce(loss: Grid, mask: Grid, seqs: list, reduction: str, gt: float, gs: float) -> float:
    if reduction in ("token_mean", "seq_mean_token_sum_norm"):
        total = 0.0
        for r in range(len(loss)):
            for t in range(len(loss[0])):
                total += mask[r][t] * loss[r][t]
        return total / gt if reduction == "token_mean" else total / (NORM_TOKENS * gs)
    total = 0.0
    for seq in seqs:
        n = sum(mask[r][t] for r, t in seq)
        if n > 0:
            total += sum(mask[r][t] * loss[r][t] for r, t in seq) / n
    return total / gs


def _ref_policy(
    b: Batch,
    logp: Grid,
    *,
    level: str,
    reduction: str,
    eps: float,
    eps_high: float,
    c: float | None,
    use_weights: bool,
) -> tuple[float, dict[str, float]]:
    rows, length = b.shape
    adv = b.adv_token if level == "token" else b.adv_seq
    ratio = [[math.exp(logp[r][t] - b.old_logp[r][t]) for t in range(length)] for r in range(rows)]
    if level == "sequence":
        for seq in b.sequences():
            n = sum(b.mask[r][t] for r, t in seq)
            mean = sum(b.mask[r][t] * (logp[r][t] - b.old_logp[r][t]) for r, t in seq) / max(n, 1.0)
            for r, t in seq:
                ratio[r][t] = math.exp(mean)
    loss = [[0.0] * length for _ in range(rows)]
    counts = {"none": 0.0, "clip": 0.0, "dual": 0.0, "clip_pos": 0.0, "clip_neg": 0.0}
    kl, tokens = 0.0, 0.0
    for r in range(rows):
        for t in range(length):
            value, case = _ref_clip(ratio[r][t], adv[r][t], eps, eps_high, c)
            loss[r][t] = value * (b.weights[r][t] if use_weights else 1.0)
            if b.mask[r][t] > 0:
                tokens += 1
                kl += b.old_logp[r][t] - logp[r][t]
                # clipfrac counts where the clipped branch was the max, even if dual clip then applies
                clip_branch = (
                    -adv[r][t] * min(max(ratio[r][t], 1 - eps), 1 + eps_high) > -adv[r][t] * ratio[r][t]
                )
                counts["clip"] += clip_branch
                counts["dual"] += case == "dual"
                counts["clip_pos"] += clip_branch and adv[r][t] > 0
                counts["clip_neg"] += clip_branch and adv[r][t] < 0
    total = _ref_reduce(loss, b.mask, b.sequences(), reduction, b.global_tokens(), b.global_seqs())
    stats = {
        "clipfrac": counts["clip"] / tokens,
        "dual_clipfrac": counts["dual"] / tokens,
        "ppo_kl": kl / tokens,
        "clip_pos": counts["clip_pos"],
        "clip_neg": counts["clip_neg"],
        "dual": counts["dual"],
    }
    return total, stats


def _ref_kl(logp: float, ref: float, kind: str) -> float:
    if kind == "k1":
        return logp - ref
    if kind == "k2":
        return 0.5 * (logp - ref) ** 2
    x = ref - logp
    k3 = math.exp(x) - x - 1 if x < 700 else math.inf
    return min(max(k3, -10.0), 10.0) if kind == "low_var_kl" else k3


# ---------------------------------------------------------------------------------------------------
# Implementation calls
# ---------------------------------------------------------------------------------------------------

PARAMS = {
    "token": {"eps_clip": 0.2, "eps_clip_high": 0.28, "dual_clip_c": 1.5},
    "sequence": {"eps_clip": 0.1, "eps_clip_high": 0.15, "dual_clip_c": 1.2},
}


def _impl_policy(
    b: Batch, logp: torch.Tensor, *, level: str, reduction: str, use_weights: bool, gt=None, gs=None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    adv = b.adv_token if level == "token" else b.adv_seq
    return alg.policy_loss(
        logp,
        _t(b.old_logp),
        _t(adv),
        _t(b.mask),
        **PARAMS[level],
        seq_index_BS=torch.tensor(b.ids),
        level=level,
        reduction=reduction,
        global_tokens=b.global_tokens() if gt is None else gt,
        global_seqs=b.global_seqs() if gs is None else gs,
        norm_tokens=NORM_TOKENS,
        is_weights_BS=_t(b.weights) if use_weights else None,
    )


def _ref_policy_for(b: Batch, logp: Grid, level: str, reduction: str, use_weights: bool):
    p = PARAMS[level]
    return _ref_policy(
        b,
        logp,
        level=level,
        reduction=reduction,
        eps=p["eps_clip"],
        eps_high=p["eps_clip_high"],
        c=p["dual_clip_c"],
        use_weights=use_weights,
    )


# ---------------------------------------------------------------------------------------------------
# 1. Advantages
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("std", ["unbiased", "population"])
def test_grpo_advantages(seed: int, normalize_std: bool, std: str) -> None:
    rng = random.Random(seed)
    groups = [[float(rng.random() < 0.5) + rng.gauss(0, 0.1) for _ in range(5)] for _ in range(4)]
    groups.append([1.0] * 5)  # identical rewards: no signal, advantage exactly 0
    expected = []
    for g in groups:
        mean = sum(g) / len(g)
        dof = len(g) - 1 if std == "unbiased" else len(g)
        sd = math.sqrt(sum((x - mean) ** 2 for x in g) / dof)
        expected.append([(x - mean) / (sd + 1e-6) if normalize_std else x - mean for x in g])
    got = alg.grpo_advantages(_t(groups), normalize_std, std=std)
    torch.testing.assert_close(got, _t(expected), rtol=0, atol=1e-12)
    # GSPO uses GRPO's advantages
    torch.testing.assert_close(alg.sample_advantages("gspo", _t(groups), normalize_std, std=std), got)


@pytest.mark.parametrize("std", ["unbiased", "population"])
def test_grpo_singleton_groups_are_zero_not_nan(std: str) -> None:
    got = alg.grpo_advantages(_t([[0.3], [1.0]]), normalize_std=True, std=std)
    assert got.tolist() == [[0.0], [0.0]]
    assert alg.rloo_advantages(_t([[0.3], [1.0]])).tolist() == [[0.0], [0.0]]


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_baseline(seed: int) -> None:
    rng = random.Random(seed)
    groups = [[rng.gauss(0, 1) for _ in range(4)] for _ in range(3)]
    expected = [[x - sum(g) / len(g) for x in g] for g in groups]
    got = alg.reinforce_plus_plus_baseline_advantages(_t(groups))
    torch.testing.assert_close(got, _t(expected), rtol=0, atol=1e-12)
    torch.testing.assert_close(alg.sample_advantages("reinforce_plus_plus_baseline", _t(groups), True), got)
    for raw in ("ppo", "reinforce_plus_plus"):
        torch.testing.assert_close(alg.sample_advantages(raw, _t(groups), True), _t(groups))


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_leave_one_out_loop(seed: int) -> None:
    rng = random.Random(seed)
    groups = [[rng.gauss(0, 1) for _ in range(5)] for _ in range(3)]
    expected = [
        [x - sum(g[k] for k in range(len(g)) if k != j) / (len(g) - 1) for j, x in enumerate(g)]
        for g in groups
    ]
    got = alg.sample_advantages("rloo", _t(groups), True)
    torch.testing.assert_close(got, _t(expected), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# 2. Token-level estimators
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("seed", SEEDS)
def test_kl_estimate(kind: str, seed: int) -> None:
    rng = random.Random(seed)
    logp = [[-rng.uniform(0, 4) for _ in range(7)] for _ in range(3)]
    ref = [[lp + rng.gauss(0, 1.5) for lp in row] for row in logp]
    if kind == "low_var_kl":  # both sides of the [-10, 10] clamp and beyond the inner +-20 clamp
        ref[0][:4] = [logp[0][0] + 30.0, logp[0][1] - 30.0, logp[0][2] + 3.0, logp[0][3] - 12.0]
    expected = [[_ref_kl(logp[r][t], ref[r][t], kind) for t in range(7)] for r in range(3)]
    torch.testing.assert_close(alg.kl_estimate(_t(logp), _t(ref), kind), _t(expected), rtol=1e-12, atol=1e-12)


def test_low_var_kl_gradient_stays_finite_for_huge_log_ratios() -> None:
    logp = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    ref = torch.tensor([-1.0 + 200.0, -1.0 - 200.0, -0.5])
    alg.kl_estimate(logp, ref, "low_var_kl").sum().backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    assert logp.grad[:2].tolist() == [0.0, 0.0]  # clamped: no gradient


def test_kl_directions_on_exact_expectations() -> None:
    """kl_estimate(p, q) estimates KL(p || q) under samples from p; mismatch k3 is KL(rollout || train)."""
    mu = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=F64)  # rollout policy (the sampler)
    pi = torch.tensor([0.2, 0.4, 0.3, 0.1], dtype=F64)  # trainer policy
    kl_mu_pi = float((mu * (mu / pi).log()).sum())
    kl_pi_mu = float((pi * (pi / mu).log()).sum())
    assert abs(kl_mu_pi - kl_pi_mu) > 1e-3  # the two directions are distinguishable here
    for kind in ("k1", "k3"):  # the unbiased estimators
        estimate = float((mu * alg.kl_estimate(mu.log(), pi.log(), kind)).sum())
        assert abs(estimate - kl_mu_pi) < 1e-12
    sums = alg.logprob_mismatch_stats(pi.log(), mu.log(), mu)  # mu as the mask = exact expectation
    assert abs(float(sums["kl_sum"]) - kl_mu_pi) < 1e-12


def _ref_steps(b: Batch, mask: Grid) -> list[list[tuple[int, int]]]:
    return [[(r, t) for r, t in seq if mask[r][t] > 0] for seq in b.sequences()]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("packed", [True, False])
def test_reinforce_plus_plus_returns(seed: int, packed: bool) -> None:
    b = _make_batch(seed)
    rng = random.Random(seed + 100)
    rows, length = b.shape
    rewards = [[rng.gauss(0, 0.1) for _ in range(length)] for _ in range(rows)]
    gamma = 0.9
    if packed:
        steps = _ref_steps(b, b.mask)
        seq_index = torch.tensor(b.ids)
    else:
        steps = [[(r, t) for t in range(length) if b.mask[r][t] > 0] for r in range(rows)]
        seq_index = None
    expected = [[0.0] * length for _ in range(rows)]
    for seq in steps:
        g = 0.0
        for r, t in reversed(seq):
            g = rewards[r][t] + gamma * g
            expected[r][t] = g
    got = alg.reinforce_plus_plus_returns(_t(rewards), _t(b.mask), gamma, seq_index)
    torch.testing.assert_close(got, _t(expected), rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae(seed: int) -> None:
    b = _make_batch(seed)
    rng = random.Random(seed + 200)
    rows, length = b.shape
    rewards = [[rng.gauss(0, 0.1) for _ in range(length)] for _ in range(rows)]
    values = [[rng.gauss(0, 1) for _ in range(length)] for _ in range(rows)]
    gamma, lambd = 0.95, 0.8
    adv = [[0.0] * length for _ in range(rows)]
    ret = [[0.0] * length for _ in range(rows)]
    for seq in _ref_steps(b, b.mask):
        next_v, next_a = 0.0, 0.0
        for r, t in reversed(seq):
            delta = rewards[r][t] + gamma * next_v - values[r][t]
            next_a = delta + gamma * lambd * next_a
            next_v = values[r][t]
            adv[r][t] = next_a
            ret[r][t] = next_a + values[r][t]
    got_adv, got_ret = alg.gae(_t(rewards), _t(values), _t(b.mask), gamma, lambd, torch.tensor(b.ids))
    torch.testing.assert_close(got_adv, _t(adv), rtol=0, atol=1e-12)
    torch.testing.assert_close(got_ret, _t(ret), rtol=0, atol=1e-12)
    # gamma = lambd = 1, V = 0: GAE is the undiscounted return-to-go
    zero = torch.zeros(rows, length, dtype=F64)
    adv1, _ = alg.gae(_t(rewards), zero, _t(b.mask), 1.0, 1.0, torch.tensor(b.ids))
    ret1 = alg.reinforce_plus_plus_returns(_t(rewards), _t(b.mask), 1.0, torch.tensor(b.ids))
    torch.testing.assert_close(adv1, ret1, rtol=0, atol=1e-12)


def test_padding_never_counts_even_if_masked() -> None:
    ids = torch.tensor([[0, 0, 1, 1, -1, -1]])
    mask = _t([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])  # a careless mask covering the padding
    rewards = _t([[1.0, 2.0, 3.0, 4.0, 100.0, 100.0]])
    got = alg.reinforce_plus_plus_returns(rewards, mask, 1.0, ids)
    assert got.tolist() == [[3.0, 2.0, 7.0, 4.0, 0.0, 0.0]]


@pytest.mark.parametrize("seed", SEEDS)
def test_whiten_and_moments(seed: int) -> None:
    b = _make_batch(seed)
    x, m = b.adv_token, b.mask
    vals = [x[r][t] for r in range(len(x)) for t in range(len(x[0])) if m[r][t] > 0]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)
    expected = [
        [(x[r][t] - mean) / math.sqrt(var + 1e-8) * m[r][t] for t in range(len(x[0]))] for r in range(len(x))
    ]
    # moments add up across a split, as they do across data-parallel ranks
    parts = [alg.masked_moments(_t(x[lo:hi]), _t(m[lo:hi])) for lo, hi in ((0, 2), (2, 6))]
    total, total_sq, count = (sum(p[i] for p in parts) for i in range(3))
    got_mean, got_var = alg.mean_var_from_moments(total, total_sq, count)
    assert count == len(vals)
    assert abs(float(got_mean) - mean) < 1e-12 and abs(float(got_var) - var) < 1e-12
    got = alg.whiten(_t(x), _t(m), got_mean, got_var)
    torch.testing.assert_close(got, _t(expected), rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------------
# 3. Policy loss: values, stats, gradients, micro-batch invariance
# ---------------------------------------------------------------------------------------------------

POLICY_CASES = [
    ("token", "token_mean", True),
    ("token", "seq_mean_token_mean", True),
    ("token", "seq_mean_token_sum_norm", True),
    ("sequence", "seq_mean_token_mean", False),
    ("sequence", "seq_mean_token_mean", True),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("level", "reduction", "use_weights"), POLICY_CASES)
def test_policy_loss_matches_reference(seed: int, level: str, reduction: str, use_weights: bool) -> None:
    b = _make_batch(seed, spread=0.4 if level == "token" else 0.6)
    expected, ref_stats = _ref_policy_for(b, b.logp, level, reduction, use_weights)
    loss, stats = _impl_policy(b, _t(b.logp), level=level, reduction=reduction, use_weights=use_weights)
    assert abs(float(loss) - expected) < 1e-12
    for key in ("clipfrac", "dual_clipfrac", "ppo_kl"):
        assert abs(float(stats[key]) - ref_stats[key]) < 1e-12, key
    assert float(stats["tokens"]) == b.global_tokens()


@pytest.mark.parametrize("seed", SEEDS)
def test_cispo_loss_and_gradient_by_hand(seed: int) -> None:
    """CISPO (MiniMax-M1, 2025, eq. 4): J = 1/N sum_t sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t
    log pi(o_t), N the step's loss tokens; we minimise -J. By hand per token: the loss value, and
    the gradient d(-J)/d logp_t = -clip(r_t) A_t / N, nonzero also where the weight is clipped (where
    PPO's clip gives 0)."""
    b = _make_batch(seed, spread=0.4)
    eps_low, eps_high = 0.2, 0.28
    n = b.global_tokens()
    logp = _t(b.logp).requires_grad_(True)
    loss, stats = alg.policy_loss(
        logp, _t(b.old_logp), _t(b.adv_token), _t(b.mask), eps_clip=eps_low, eps_clip_high=eps_high,
        global_tokens=n, surrogate="cispo",
    )  # fmt: skip
    loss.backward()
    value, clipped, kept_gradient = 0.0, 0, 0
    for r in range(len(b.logp)):
        for t in range(len(b.logp[0])):
            if b.mask[r][t] == 0:
                assert logp.grad[r, t] == 0.0
                continue
            ratio = math.exp(b.logp[r][t] - b.old_logp[r][t])
            weight = min(max(ratio, 1 - eps_low), 1 + eps_high)
            value += -weight * b.adv_token[r][t] * b.logp[r][t] / n
            expected = -weight * b.adv_token[r][t] / n
            assert abs(float(logp.grad[r, t]) - expected) < 1e-12, (r, t)
            outside = not 1 - eps_low <= ratio <= 1 + eps_high
            clipped += outside
            kept_gradient += outside and expected != 0.0
    assert abs(float(loss) - value) < 1e-12
    assert float(stats["clipfrac"]) == pytest.approx(clipped / n, abs=1e-12)
    assert kept_gradient > 0  # the case that sets CISPO apart is exercised


def test_the_policy_loss_registry_feeds_the_gate_and_the_trainer() -> None:
    from slimrl import policy_losses
    from slimrl.policy_losses import PolicyLoss
    from slimrl.preflight.checks import CHOICES

    assert CHOICES["algorithm.policy_loss"] == policy_losses.names() == tuple(PolicyLoss)
    assert set(alg.SURROGATES) == set(PolicyLoss)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_every_clip_case_is_exercised(level: str) -> None:
    """Guard for the tests above: positive and negative advantages hit their clip side and the dual clip."""
    totals = {"clip_pos": 0.0, "clip_neg": 0.0, "dual": 0.0}
    for seed in SEEDS:
        b = _make_batch(seed, spread=0.4 if level == "token" else 0.6)
        _, stats = _ref_policy_for(b, b.logp, level, "token_mean", False)
        for key in totals:
            totals[key] += stats[key]
    assert all(v > 0 for v in totals.values()), totals


@pytest.mark.parametrize("seed", SEEDS[:3])
@pytest.mark.parametrize(("level", "reduction", "use_weights"), POLICY_CASES[:4])
def test_policy_gradient_matches_finite_differences(
    seed: int, level: str, reduction: str, use_weights: bool
) -> None:
    b = _make_batch(seed, spread=0.4 if level == "token" else 0.6)
    logp = _t(b.logp).requires_grad_(True)
    loss, _ = _impl_policy(b, logp, level=level, reduction=reduction, use_weights=use_weights)
    loss.backward()
    assert logp.grad is not None
    h = 1e-6
    rows, length = b.shape
    numeric = [[0.0] * length for _ in range(rows)]
    for r in range(rows):
        for t in range(length):
            plus = [row[:] for row in b.logp]
            minus = [row[:] for row in b.logp]
            plus[r][t] += h
            minus[r][t] -= h
            up, _ = _ref_policy_for(b, plus, level, reduction, use_weights)
            down, _ = _ref_policy_for(b, minus, level, reduction, use_weights)
            numeric[r][t] = (up - down) / (2 * h)
    torch.testing.assert_close(logp.grad, _t(numeric), rtol=0, atol=1e-8)


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_gradient_is_the_analytic_per_token_gradient(seed: int) -> None:
    """d loss / d logp_t = -A_i s_i w_t [sequence i not clipped] / (n_i G), with IS weights w_t."""
    reduction = "seq_mean_token_mean"
    b = _make_batch(seed, spread=0.6)
    p = PARAMS["sequence"]
    logp = _t(b.logp).requires_grad_(True)
    loss, _ = _impl_policy(b, logp, level="sequence", reduction=reduction, use_weights=True)
    loss.backward()
    expected = [[0.0] * b.shape[1] for _ in range(b.shape[0])]
    for seq in b.sequences():
        n = sum(b.mask[r][t] for r, t in seq)
        if n == 0:
            continue
        s = math.exp(sum(b.mask[r][t] * (b.logp[r][t] - b.old_logp[r][t]) for r, t in seq) / n)
        a = b.adv_seq[seq[0][0]][seq[0][1]]
        _, case = _ref_clip(s, a, p["eps_clip"], p["eps_clip_high"], p["dual_clip_c"])
        norm = n * b.global_seqs()
        for r, t in seq:
            if case == "none":
                expected[r][t] = -a * s * b.weights[r][t] * b.mask[r][t] / norm
    torch.testing.assert_close(logp.grad, _t(expected), rtol=0, atol=1e-14)


SPLITS = [(0, 1), (1, 4), (4, 6)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("level", "reduction", "use_weights"), POLICY_CASES)
def test_policy_loss_micro_batches_add_up(seed: int, level: str, reduction: str, use_weights: bool) -> None:
    b = _make_batch(seed)
    gt, gs = b.global_tokens(), b.global_seqs()
    whole, _ = _impl_policy(b, _t(b.logp), level=level, reduction=reduction, use_weights=use_weights)
    parts = 0.0
    for lo, hi in SPLITS:  # sequence ids keep their whole-batch values: only id changes matter
        part = b.rows(lo, hi)
        loss, _ = _impl_policy(
            part, _t(part.logp), level=level, reduction=reduction, use_weights=use_weights, gt=gt, gs=gs
        )
        parts += float(loss)
    assert abs(parts - float(whole)) < 1e-12


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_kl_loss_and_entropy_bonus(seed: int, reduction: str) -> None:
    b = _make_batch(seed)
    rows, length = b.shape
    ref = b.old_logp  # any second set of logprobs
    entropy = [[abs(x) for x in row] for row in b.adv_token]
    kl = [[_ref_kl(b.logp[r][t], ref[r][t], "low_var_kl") for t in range(length)] for r in range(rows)]
    gt, gs, seqs = b.global_tokens(), b.global_seqs(), b.sequences()
    kw = {
        "reduction": reduction,
        "global_seqs": gs,
        "seq_index_BS": torch.tensor(b.ids),
        "norm_tokens": NORM_TOKENS,
    }
    got_kl = alg.kl_loss(_t(b.logp), _t(ref), _t(b.mask), "low_var_kl", gt, **kw)
    got_ent = alg.entropy_bonus(_t(entropy), _t(b.mask), gt, **kw)
    assert abs(float(got_kl) - _ref_reduce(kl, b.mask, seqs, reduction, gt, gs)) < 1e-12
    assert abs(float(got_ent) - _ref_reduce(entropy, b.mask, seqs, reduction, gt, gs)) < 1e-12
    split_kl = sum(
        float(
            alg.kl_loss(
                _t(b.logp[lo:hi]),
                _t(ref[lo:hi]),
                _t(b.mask[lo:hi]),
                "low_var_kl",
                gt,
                reduction=reduction,
                global_seqs=gs,
                seq_index_BS=torch.tensor(b.ids[lo:hi]),
                norm_tokens=NORM_TOKENS,
            )
        )
        for lo, hi in SPLITS
    )
    assert abs(split_kl - float(got_kl)) < 1e-12


def _ref_value_loss(values: Grid, old: Grid, returns: Grid, mask: Grid, clip: float, gt: float) -> float:
    total = 0.0
    for r in range(len(values)):
        for t in range(len(values[0])):
            v_clip = old[r][t] + min(max(values[r][t] - old[r][t], -clip), clip)
            worst = max((values[r][t] - returns[r][t]) ** 2, (v_clip - returns[r][t]) ** 2)
            total += mask[r][t] * 0.5 * worst
    return total / gt


@pytest.mark.parametrize("seed", SEEDS)
def test_value_loss(seed: int) -> None:
    b = _make_batch(seed)
    rng = random.Random(seed + 300)
    rows, length = b.shape
    values = [[rng.gauss(0, 1) for _ in range(length)] for _ in range(rows)]
    old = [[v + rng.gauss(0, 0.3) for v in row] for row in values]
    returns = [[rng.gauss(0, 1) for _ in range(length)] for _ in range(rows)]
    gt, clip = b.global_tokens(), 0.2
    v = _t(values).requires_grad_(True)
    loss, stats = alg.value_loss(v, _t(old), _t(returns), _t(b.mask), clip, gt)
    assert abs(float(loss.detach()) - _ref_value_loss(values, old, returns, b.mask, clip, gt)) < 1e-12
    assert 0.0 < float(stats["value_clipfrac"]) < 1.0
    loss.backward()
    h = 1e-6
    for r in range(rows):
        for t in range(length):
            plus = [row[:] for row in values]
            minus = [row[:] for row in values]
            plus[r][t] += h
            minus[r][t] -= h
            numeric = (
                _ref_value_loss(plus, old, returns, b.mask, clip, gt)
                - _ref_value_loss(minus, old, returns, b.mask, clip, gt)
            ) / (2 * h)
            assert v.grad is not None and abs(float(v.grad[r, t]) - numeric) < 1e-8
    parts = sum(
        float(
            alg.value_loss(
                _t(values[lo:hi]), _t(old[lo:hi]), _t(returns[lo:hi]), _t(b.mask[lo:hi]), clip, gt
            )[0]
        )
        for lo, hi in SPLITS
    )
    assert abs(parts - float(loss.detach())) < 1e-12


# ---------------------------------------------------------------------------------------------------
# 4. Train/rollout mismatch
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_mismatch_stats_and_tis(seed: int) -> None:
    b = _make_batch(seed)
    train, rollout, m = b.logp, b.old_logp, b.mask
    rows, length = b.shape
    abs_sum = kl_sum = count = 0.0
    for r in range(rows):
        for t in range(length):
            if m[r][t] > 0:
                rho = math.exp(train[r][t] - rollout[r][t])
                abs_sum += abs(train[r][t] - rollout[r][t])
                kl_sum += rho - math.log(rho) - 1
                count += 1
    sums = alg.logprob_mismatch_stats(_t(train), _t(rollout), _t(m))
    assert abs(float(sums["abs_diff_sum"]) - abs_sum) < 1e-12
    assert abs(float(sums["kl_sum"]) - kl_sum) < 1e-12
    assert float(sums["tokens"]) == count
    metrics = alg.mismatch_metrics(sums)
    assert abs(metrics["train/train_rollout_logprob_abs_diff"] - abs_sum / count) < 1e-12
    assert abs(metrics["train/train_rollout_kl"] - kl_sum / count) < 1e-12

    lp = _t(train).requires_grad_(True)
    weights = alg.truncated_is_weights(lp, _t(rollout), 0.8, 1.25)
    assert not weights.requires_grad
    expected = [
        [min(max(math.exp(train[r][t] - rollout[r][t]), 0.8), 1.25) for t in range(length)]
        for r in range(rows)
    ]
    torch.testing.assert_close(weights, _t(expected), rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_masked_is(seed: int, level: str) -> None:
    b = _make_batch(seed)
    train, rollout, m = b.logp, b.old_logp, b.mask
    low, high = {"token": (0.7, 1.4), "sequence": (0.5, 2.0), "geometric": (0.85, 1.15)}[level]
    expected = [row[:] for row in m]
    if level == "token":
        for r in range(len(m)):
            for t in range(len(m[0])):
                if not low <= math.exp(train[r][t] - rollout[r][t]) <= high:
                    expected[r][t] = 0.0
    else:
        for seq in b.sequences():
            n = sum(m[r][t] for r, t in seq)
            total = sum(m[r][t] * (train[r][t] - rollout[r][t]) for r, t in seq)
            log_rho = total if level == "sequence" else total / max(n, 1.0)  # product / geometric mean
            if not low <= math.exp(log_rho) <= high:
                for r, t in seq:
                    expected[r][t] = 0.0
    before = sum(map(sum, m))
    dropped = (before - sum(map(sum, expected))) / before
    new_mask, frac = alg.masked_is(_t(train), _t(rollout), _t(m), low, high, level, torch.tensor(b.ids))
    assert _grid(new_mask) == expected
    assert abs(float(frac) - dropped) < 1e-12
    assert 0.0 < dropped < 1.0


def test_bad_choices_are_config_errors() -> None:
    x = torch.zeros(1, 2, dtype=F64)
    with pytest.raises(ConfigError, match="kl_estimator"):
        alg.kl_estimate(x, x, "k4")
    with pytest.raises(ConfigError, match="loss_reduction"):
        alg.reduce_loss(x, x, reduction="sum", global_tokens=1)
    with pytest.raises(ConfigError, match="dual_clip_c"):
        alg.policy_loss(x, x, x, x, eps_clip=0.2, dual_clip_c=1.0, global_tokens=1)
    with pytest.raises(ConfigError, match="advantage_estimator"):
        alg.sample_advantages("dpo", x, True)
    with pytest.raises(ConfigError, match="grpo_std"):
        alg.grpo_advantages(x, True, std="sample")
    with pytest.raises(ConfigError, match="mis_level"):
        alg.masked_is(x, x, x, 0.5, 2.0, "seq_max")
    for reduction in ("token_mean", "seq_mean_token_sum_norm"):  # GSPO is a mean over sequences
        with pytest.raises(ConfigError, match="seq_mean_token_mean"):
            alg.policy_loss(
                x,
                x,
                x,
                x,
                eps_clip=0.2,
                level="sequence",
                reduction=reduction,
                global_tokens=1,
                global_seqs=1,
            )


# ---------------------------------------------------------------------------------------------------
# 5. The papers' formulas on hand-worked examples (expected numbers worked out by hand from the
#    formula in each docstring, not by our code), through the driver and trainer code paths
# ---------------------------------------------------------------------------------------------------


def _config(**algorithm: object) -> SlimConfig:
    config = SlimConfig()
    for key, value in algorithm.items():
        setattr(config.algorithm, key, value)
    return config


def _actor(config: SlimConfig, all_reduce=None) -> SimpleNamespace:
    """What `rl._token_level_advantages` uses of a `MegatronActor`: the config and its step runner's
    DP all-reduce."""
    runner = SimpleNamespace(sum_over_dp=all_reduce or (lambda values: dict(values)))
    return SimpleNamespace(config=config, runner=runner)


class _ThreadAllReduce:
    """A sum all-reduce between `n` threads standing in for data-parallel ranks."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n)
        self.slots: list[dict[str, float]] = [{} for _ in range(n)]

    def for_rank(self, rank: int):
        def all_reduce(values: dict[str, float]) -> dict[str, float]:
            self.slots[rank] = dict(values)
            self.barrier.wait()
            total = {k: sum(slot[k] for slot in self.slots) for k in values}
            self.barrier.wait()  # nobody overwrites a slot before everyone has read it
            return total

        return all_reduce


def _sample(index: int, group: int, reward: float, loss_mask: list[int], **kw: object) -> Sample:
    n = len(loss_mask)
    # The first prompt token is the sample's index, so a sample can be found again after the DP split.
    fields: dict = {"status": Status.COMPLETED, **kw}
    return Sample(
        index=index,
        group_index=group,
        tokens=[index, 200, *[7] * n],
        response_length=n,
        loss_mask=loss_mask,
        reward=reward,
        **fields,
    )


def _token_advantages(config: SlimConfig, groups: list[list[Sample]], dp: int) -> dict[int, list[float]]:
    """Driver (`train_batches`) then trainer (`_token_level_advantages`) on `dp` threads."""
    batches = train_batches(config, groups, dp)
    reducer = _ThreadAllReduce(dp)
    threads = [
        threading.Thread(target=rl._token_level_advantages, args=(_actor(config, reducer.for_rank(k)), b))
        for k, b in enumerate(batches)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {
        tokens[0]: values
        for b in batches
        for tokens, values in zip(b.tokens, b.per_token.advantages, strict=True)
    }


@pytest.mark.parametrize("dp", [1, 2])
def test_reinforce_plus_plus_baseline_is_group_centred_then_batch_whitened(dp: int) -> None:
    """REINFORCE++-baseline (Hu et al. 2025): A = r - mean_group(r), then whitened with the mean and
    std of A over every loss token of the batch (all DP ranks); tool tokens (loss mask 0) get 0.

    Groups (1, 0) and (3, 1) centre to (0.5, -0.5) and (1, -1). With gamma 1 every loss token carries
    its sample's value: 0.5 x2 (two tokens), -0.5, 1 x2 (a tool token between), -1. Over those six
    tokens mean = 1.5/6 = 0.25, E[x^2] = 3.75/6 = 0.625, var = 0.625 - 0.0625 = 0.5625, std = 0.75,
    so the advantages are (0.5-0.25)/0.75 = 1/3, (-0.5-0.25)/0.75 = -1, (1-0.25)/0.75 = 1 and
    (-1-0.25)/0.75 = -5/3.
    """
    config = _config(advantage_estimator="reinforce_plus_plus_baseline")
    groups = [
        [_sample(0, 0, 1.0, [1, 1]), _sample(1, 0, 0.0, [1])],
        [_sample(2, 1, 3.0, [1, 0, 1]), _sample(3, 1, 1.0, [1])],
    ]
    got = _token_advantages(config, groups, dp)
    scale = 0.75 / math.sqrt(0.5625 + 1e-8)  # whiten's eps inside the square root
    expected = {0: [1 / 3, 1 / 3], 1: [-1.0], 2: [1.0, 0.0, 1.0], 3: [-5 / 3]}
    assert got.keys() == expected.keys()
    for index, values in expected.items():
        assert got[index] == pytest.approx([v * scale for v in values], abs=1e-12), index


@pytest.mark.parametrize("dp", [1, 2])
def test_reinforce_plus_plus_uses_the_loss_mask_for_kl_returns_and_whitening(dp: int) -> None:
    """REINFORCE++: r_t = R [t = last loss token] - kl_coef * KL_t on loss tokens only, G_t = r_t +
    gamma G_next over loss tokens only, whitened over the batch's loss tokens.

    Sample 0: loss mask (1, 1, 0, 1, 0) (tool output at 2 and 4), R = 1, kl_coef 0.1, k1 KL per token
    (1, 2, 50, 3, 40), gamma 0.5. Rewards on the action tokens: -0.1, -0.2, 1 - 0.3 = 0.7; returns:
    G3 = 0.7, G1 = -0.2 + 0.5 * 0.7 = 0.15, G0 = -0.1 + 0.5 * 0.15 = -0.025. Sample 1 (no tool
    tokens, R = 0, KL 0): returns 0, 0. Whitening over the five loss tokens (-0.025, 0.15, 0.7, 0, 0):
    mean = 0.825/5 = 0.165, E[x^2] = (0.000625 + 0.0225 + 0.49)/5 = 0.102625, var = 0.102625 -
    0.027225 = 0.0754.
    """
    config = _config(advantage_estimator="reinforce_plus_plus", kl_coef=0.1, kl_estimator="k1", gamma=0.5)
    groups = [[_sample(0, 0, 1.0, [1, 1, 0, 1, 0]), _sample(1, 0, 0.0, [1, 1])]]
    old = {0: [-0.5] * 5, 1: [-0.5] * 2}
    ref = {0: [-1.5, -2.5, -50.5, -3.5, -40.5], 1: [-0.5] * 2}  # old - ref = k1 = (1, 2, 50, 3, 40)
    batches = train_batches(config, groups, dp)
    for b in batches:
        b.per_token.old_logp = [old[tokens[0]] for tokens in b.tokens]
        b.per_token.ref_logp = [ref[tokens[0]] for tokens in b.tokens]
    reducer = _ThreadAllReduce(dp)
    threads = [
        threading.Thread(target=rl._token_level_advantages, args=(_actor(config, reducer.for_rank(k)), b))
        for k, b in enumerate(batches)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    got = {t[0]: v for b in batches for t, v in zip(b.tokens, b.per_token.advantages, strict=True)}
    mean, std = 0.165, math.sqrt(0.0754 + 1e-8)  # whiten's eps inside the square root
    w = lambda x: (x - mean) / std  # noqa: E731
    assert got[0] == pytest.approx([w(-0.025), w(0.15), 0.0, w(0.7), 0.0], abs=1e-12)
    assert got[1] == pytest.approx([w(0.0), w(0.0)], abs=1e-12)


def test_gspo_is_the_mean_over_sequences_of_the_sequence_objective() -> None:
    """GSPO (Zheng et al. 2025): J = 1/G sum_i min(s_i A_i, clip(s_i, 1-eps, 1+eps) A_i) with
    s_i = exp(mean_t (logp_t - old_t)).

    Sequence a: log-ratios (0.1, 0.3), s_a = e^0.2 = 1.2214 > 1.2, A_a = 1: clipped, term 1.2,
    gradient 0. Sequence b: log-ratios (-0.1, -0.1, 0, 0.2), s_b = 1, A_b = -1: term -1, d term /
    d logp_t = A_b s_b / |b| = -1/4. Loss = -(1.2 - 1)/2 = -0.1; d loss / d logp_t = 1/4 / 2 = 0.125
    on b's tokens. (Weighting by length, token_mean, would give (2 * -1.2 + 4 * 1)/6 = 0.267.)
    """
    old = _t([[0.0] * 6])
    logp = (old + _t([[0.1, 0.3, -0.1, -0.1, 0.0, 0.2]])).requires_grad_(True)
    adv = _t([[1.0, 1.0, -1.0, -1.0, -1.0, -1.0]])
    loss, stats = alg.policy_loss(
        logp,
        old,
        adv,
        torch.ones(1, 6, dtype=F64),
        eps_clip=0.2,
        seq_index_BS=torch.tensor([[0, 0, 1, 1, 1, 1]]),
        level="sequence",
        reduction="seq_mean_token_mean",
        global_tokens=6,
        global_seqs=2,
    )
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-0.1, abs=1e-12)
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, _t([[0.0, 0.0, 0.125, 0.125, 0.125, 0.125]]), rtol=0, atol=1e-12)
    assert float(stats["clipfrac"]) == pytest.approx(2 / 6)


@pytest.mark.parametrize(
    ("reduction", "kl", "entropy"),
    [
        # k1 per token (0.2 | 0.1, -0.1, 0.3), entropy (0.6 | 0.3, 0.3, 0.9): sequence a has 1 token, b 3
        ("token_mean", 0.5 / 4, 2.1 / 4),
        ("seq_mean_token_mean", (0.2 + 0.3 / 3) / 2, (0.6 + 1.5 / 3) / 2),
        ("seq_mean_token_sum_norm", (0.2 + 0.3) / (4 * 2), (0.6 + 1.5) / (4 * 2)),  # constant 4
    ],
)
def test_kl_loss_and_entropy_use_the_policy_loss_reduction(reduction: str, kl: float, entropy: float) -> None:
    """The trainer's loss (`rl.rl_loss`) reduces the KL loss and the entropy bonus like the policy loss."""
    algo = _config(loss_reduction=reduction, kl_loss_coef=1.0, kl_estimator="k1", entropy_coef=0.5).algorithm
    logp = torch.zeros(1, 4, dtype=F64, requires_grad=True)
    per_token = PerToken(advantages=torch.zeros(1, 4, dtype=F64), ref_logp=_t([[-0.2, -0.1, 0.1, -0.3]]))
    loss, report = rl.rl_loss(
        algo,
        logp,
        _t([[0.6, 0.3, 0.3, 0.9]]),
        torch.ones(1, 4, dtype=F64),
        torch.tensor([[0, 1, 1, 1]]),
        per_token,
        global_tokens=4,
        global_seqs=2,
        norm_tokens=4,
    )
    assert float(report["kl_loss"]) == pytest.approx(kl, abs=1e-12)
    assert float(report["entropy"]) == pytest.approx(entropy, abs=1e-12)
    assert float(loss.detach()) == pytest.approx(kl - 0.5 * entropy, abs=1e-12)  # pg is 0: advantages are 0


def test_dr_grpo_constant_normaliser() -> None:
    """Dr.GRPO (Liu et al. 2025): A = r - mean_group(r) (no std), and the loss is each sequence's
    token SUM divided by a constant (the max response length L), averaged over the G sequences.

    Rewards (1, 0, 0, 1) -> A = (0.5, -0.5, -0.5, 0.5). Loss at ratio 1 for sequence a (2 tokens, A = 1)
    and b (1 token, A = -1), L = 4, G = 2: (-1 - 1 + 1) / (4 * 2) = -0.125; d loss / d logp_t = -A_t / 8.
    """
    got = alg.sample_advantages("grpo", _t([[1.0, 0.0, 0.0, 1.0]]), False)
    assert got.tolist() == [[0.5, -0.5, -0.5, 0.5]]
    logp = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    loss, _ = alg.policy_loss(
        logp,
        torch.zeros(1, 3, dtype=F64),
        _t([[1.0, 1.0, -1.0]]),
        torch.ones(1, 3, dtype=F64),
        eps_clip=0.2,
        seq_index_BS=torch.tensor([[0, 0, 1]]),
        reduction="seq_mean_token_sum_norm",
        global_tokens=3,
        global_seqs=2,
        norm_tokens=4,
    )
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-0.125, abs=1e-12)
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, _t([[-0.125, -0.125, 0.125]]), rtol=0, atol=1e-12)
    # the default constant is the maximum response length
    assert rl.loss_normaliser_tokens(_config()) == SlimConfig().rollout.sampling.max_new_tokens
    assert rl.loss_normaliser_tokens(_config(loss_norm_tokens=512)) == 512


def test_grpo_std_options_and_rloo_by_hand() -> None:
    """GRPO, group (1, 0): mean 0.5; unbiased std sqrt(0.5 / 1), population std sqrt(0.5 / 2) = 0.5.
    RLOO: A_i = r_i - mean of the others: (1, 0, 0, 1) -> 1 - 1/3 = 2/3, 0 - 2/3 = -2/3;
    (3, 1, 2, 6) -> 3 - 9/3 = 0, 1 - 11/3 = -8/3, 2 - 10/3 = -4/3, 6 - 6/3 = 4."""
    unbiased = alg.sample_advantages("grpo", _t([[1.0, 0.0]]), True)  # the default
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(unbiased, _t([[a, -a]]), rtol=0, atol=1e-12)
    population = alg.sample_advantages("grpo", _t([[1.0, 0.0]]), True, std="population")
    a = 0.5 / (0.5 + 1e-6)
    torch.testing.assert_close(population, _t([[a, -a]]), rtol=0, atol=1e-12)
    rloo = alg.sample_advantages("rloo", _t([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 6.0]]), True)
    expected = [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0, -8 / 3, -4 / 3, 4.0]]
    torch.testing.assert_close(rloo, _t(expected), rtol=0, atol=1e-12)
    # the driver passes algorithm.grpo_std through
    groups = [[_sample(0, 0, 1.0, [1]), _sample(1, 0, 0.0, [1])]]
    assert sample_advantages(_config(grpo_std="population"), groups) == pytest.approx(
        population.reshape(-1).tolist()
    )


def test_importance_sampling_levels_by_hand() -> None:
    """TIS/MIS ratios (Yao et al. 2025; Geo-RS as verl's geometric rejection sampling). Sequence a has
    log-ratios (0.1, 0.2), b (0.5, 0.5, 0.5). token: rho_t = e^d_t. sequence: the product e^(sum d):
    a e^0.3 = 1.35, b e^1.5 = 4.48. geometric: e^(mean d): a e^0.15 = 1.16, b e^0.5 = 1.65.
    TIS clip [0, 2]; MIS keeps [0.5, 2]: token keeps all, sequence drops b, geometric keeps both."""
    rollout = torch.zeros(1, 6, dtype=F64)
    train = _t([[0.1, 0.2, 0.5, 0.5, 0.5, 0.0]])
    mask = _t([[1, 1, 1, 1, 1, 0]])
    ids = torch.tensor([[0, 0, 1, 1, 1, -1]])
    e = math.exp
    token = alg.truncated_is_weights(train, rollout, 0.0, 2.0, level="token", mask_BS=mask, seq_index_BS=ids)
    assert token[0, :5].tolist() == pytest.approx([e(0.1), e(0.2), e(0.5), e(0.5), e(0.5)], abs=1e-12)
    seq = alg.truncated_is_weights(train, rollout, 0.0, 2.0, level="sequence", mask_BS=mask, seq_index_BS=ids)
    assert seq[0, :5].tolist() == pytest.approx([e(0.3), e(0.3), 2.0, 2.0, 2.0], abs=1e-12)
    kept = {
        level: alg.masked_is(train, rollout, mask, 0.5, 2.0, level, ids)[0][0].tolist()
        for level in ("token", "sequence", "geometric")
    }
    assert kept == {
        "token": [1.0, 1.0, 1.0, 1.0, 1.0, 0.0],
        "sequence": [1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
        "geometric": [1.0, 1.0, 1.0, 1.0, 1.0, 0.0],
    }


def test_dapo_overlong_reward_shaping_by_hand() -> None:
    """DAPO eq. 13 with L_max = 10, L_cache = 4 (so L_max - L_cache = 6): 0 up to 6 tokens,
    (6 - |y|)/4 from 7 to 10, -1 beyond 10."""
    lengths = torch.tensor([3, 6, 7, 9, 10, 12])
    got = alg.overlong_reward(lengths, max_len=10, buffer_len=4)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    assert alg.overlong_reward(lengths, 10, 4, penalty_factor=0.5).tolist() == [
        0.0,
        0.0,
        -0.125,
        -0.375,
        -0.5,
        -0.5,
    ]
    # the driver adds it to the reward before the group statistics: group (1 @ 9 tokens, 0 @ 3 tokens)
    config = _config(overlong_buffer_len=4, normalize_std=False)
    config.rollout.sampling.max_new_tokens = 10
    groups = [[_sample(0, 0, 1.0, [1] * 9), _sample(1, 0, 0.0, [1] * 3)]]
    # shaped rewards 1 - 0.75 = 0.25 and 0: mean 0.125
    assert sample_advantages(config, groups) == pytest.approx([0.125, -0.125])


def test_remove_sample_and_overlong_filtering_zero_the_loss_mask() -> None:
    """`Sample.remove_sample` and DAPO overlong filtering (truncated samples) leave the sample in its
    group's statistics but out of training: loss mask all zero, not in the token or sequence counts."""
    config = _config(overlong_filtering=True)
    kept, removed = _sample(0, 0, 1.0, [1, 1, 0, 1]), _sample(1, 0, 0.0, [1, 1], remove_sample=True)
    truncated = _sample(2, 0, 0.5, [1, 1, 1], status=Status.TRUNCATED)
    (batch,) = train_batches(config, [[kept, removed, truncated]], 1)
    masks = {tokens[0]: mask for tokens, mask in zip(batch.tokens, batch.loss_masks, strict=True)}
    assert masks == {0: [1, 1, 0, 1], 1: [0, 0], 2: [0, 0, 0]}
    assert batch.global_num_tokens == 3
    assert rl.step_counts(batch.loss_masks) == {"tokens": 3.0, "seqs": 1.0}
    # group statistics still include them: GRPO (unbiased std) over rewards (1, 0, 0.5)
    advantages = {t[0]: v[0] for t, v in zip(batch.tokens, batch.per_token.advantages, strict=True)}
    assert advantages[0] == pytest.approx(0.5 / (0.5 + 1e-6))
    # without overlong filtering a truncated sample trains
    (batch,) = train_batches(_config(), [[_sample(2, 0, 0.5, [1, 1], status=Status.TRUNCATED)] * 2], 1)
    assert batch.loss_masks == [[1, 1], [1, 1]]


def test_dynamic_sampling_std_threshold() -> None:
    """DAPO dynamic sampling: threshold 0 drops only all-equal groups; threshold t keeps a group iff
    its reward std (population) > t.
    (1,0,0,0): std sqrt(3/16) = 0.433; (1,0,...,0) of 8: sqrt(7/64) = 0.331."""
    group = lambda *rewards: [_sample(i, 0, r, [1]) for i, r in enumerate(rewards)]  # noqa: E731
    config = _config()
    assert filters.nonzero_reward_std(config, group(1.0, 1.0))[0] is False
    assert filters.nonzero_reward_std(config, group(1.0, 0.0))[0] is True
    config.rollout.dynamic_sampling_std_threshold = 0.4
    assert filters.nonzero_reward_std(config, group(1.0, 0.0, 0.0, 0.0))[0] is True
    assert filters.nonzero_reward_std(config, group(1.0, *[0.0] * 7)) == (False, "low_std")


# ---------------------------------------------------------------------------------------------------
# 6. Numerics guards: the log-ratio clamp, finite loss and gradient for any masked or extreme token
# ---------------------------------------------------------------------------------------------------


def test_log_ratio_is_clamped_before_exp() -> None:
    """r = exp(clamp(logp - old, -20, 20)): a token at logp - old = 1000 with A = -1 (no dual clip)
    costs exactly e^20 and has gradient 0, instead of inf / nan."""
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    loss, _ = alg.policy_loss(
        logp,
        torch.tensor([[-1000.0, 1000.0]]),
        torch.tensor([[-1.0, 1.0]]),
        torch.ones(1, 2),
        eps_clip=0.2,
        global_tokens=1,
    )
    loss.backward()
    # token 0: max(e^20, 1.2) = e^20; token 1: ratio e^-20, max(-e^-20, -0.8) = -e^-20
    assert float(loss.detach()) == pytest.approx(math.exp(20) - math.exp(-20), rel=1e-6)
    assert logp.grad is not None and logp.grad[0, 0] == 0.0 and torch.isfinite(logp.grad).all()


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("estimator", "reduction"),
    [
        ("grpo", "token_mean"),
        ("grpo", "seq_mean_token_mean"),
        ("grpo", "seq_mean_token_sum_norm"),
        ("gspo", "seq_mean_token_mean"),
    ],
)
@pytest.mark.parametrize("tis_level", ["token", "sequence"])
@pytest.mark.parametrize("mis_level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_and_masked_tokens_give_finite_loss_and_gradient(
    estimator: str, reduction: str, tis_level: str, mis_level: str, kl_estimator: str, dtype: torch.dtype
) -> None:
    """logp - old = +-1000 on trained tokens, inf/nan under the mask in every input: loss and
    gradient finite, and no gradient at all on masked positions."""
    algo = _config(
        advantage_estimator=estimator,
        loss_reduction=reduction,
        tis=True,
        tis_level=tis_level,
        mis=True,
        mis_level=mis_level,
        mis_low=0.0,
        mis_high=1e30,  # keep every trained token so the extreme ones reach the loss
        kl_loss_coef=0.1,
        kl_estimator=kl_estimator,
        entropy_coef=0.01,
        dual_clip_c=3.0,
    ).algorithm
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0]], dtype=dtype)  # two sequences, padding at the end
    ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1]])
    logp = torch.tensor([[-INF, -1.0, -2.0, -0.5, NAN, -1.0, -3.0, INF]], dtype=dtype, requires_grad=True)
    per_token = PerToken(
        old_logp=torch.tensor([[INF, 999.0, -1002.0, -0.4, -INF, -1001.0, 997.0, NAN]], dtype=dtype),
        rollout_logp=torch.tensor([[NAN, -1001.0, 998.0, -0.5, INF, 999.0, -1003.0, -INF]], dtype=dtype),
        ref_logp=torch.tensor([[INF, 1000.0, -1000.0, -0.6, NAN, -999.0, 1000.0, -INF]], dtype=dtype),
        advantages=torch.tensor([[NAN, 1.0, -1.0, 0.5, INF, -2.0, -2.0, -INF]], dtype=dtype),
    )
    entropy = torch.tensor([[INF, 1.0, 2.0, 0.5, NAN, 1.0, 0.1, INF]], dtype=dtype, requires_grad=True)
    loss, report = rl.rl_loss(
        algo, logp, entropy, mask, ids, per_token, global_tokens=5, global_seqs=2, norm_tokens=8
    )
    loss.backward()
    assert torch.isfinite(loss), float(loss)
    assert all(torch.isfinite(v).all() for v in report.values()), report
    for grad in (logp.grad, entropy.grad):
        assert grad is not None and torch.isfinite(grad).all(), grad
        assert (grad[mask == 0] == 0).all()


def test_one_registry_of_estimators_feeds_the_gate_the_driver_and_the_trainer():
    """`slimrl/estimators.py` names every estimator once: the config gate's choices, the driver's
    score table and the traits the trainer reads all hold the same names, and each trait says what
    its estimator's definition needs (a group baseline needs 2+ samples per prompt, PPO a critic)."""
    from slimrl import estimators
    from slimrl.estimators import Estimator
    from slimrl.preflight.checks import CHOICES

    assert CHOICES["algorithm.advantage_estimator"] == estimators.names() == tuple(Estimator)
    assert set(alg.SAMPLE_SCORES) == set(Estimator)
    by_trait = {
        trait: estimators.names(lambda t, trait=trait: getattr(t, trait))
        for trait in ("group_baseline", "token_level", "critic", "sequence_ratio", "std_choice")
    }
    assert by_trait == {
        "group_baseline": ("grpo", "gspo", "rloo", "reinforce_plus_plus_baseline"),
        "token_level": ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"),
        "critic": ("ppo",),
        "sequence_ratio": ("gspo",),
        "std_choice": ("grpo", "gspo"),
    }
