"""RL algorithm math against plain-Python float64 references that loop over groups, sequences and tokens.

Every batch has padding, prompt positions (mask 0), masked-out response tokens and rows packing two
sequences, so the sequence bookkeeping of GSPO, seq_mean_token_mean, returns and GAE is exercised.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

from slimrl.errors import ConfigError
from slimrl.trainer import algorithms as alg

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


def _ref_reduce(loss: Grid, mask: Grid, seqs: list, reduction: str, gt: float, gs: float) -> float:
    if reduction == "token_mean":
        total = 0.0
        for r in range(len(loss)):
            for t in range(len(loss[0])):
                total += mask[r][t] * loss[r][t]
        return total / gt
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
def test_grpo_advantages(seed: int, normalize_std: bool) -> None:
    rng = random.Random(seed)
    groups = [[float(rng.random() < 0.5) + rng.gauss(0, 0.1) for _ in range(5)] for _ in range(4)]
    groups.append([1.0] * 5)  # identical rewards: no signal, advantage exactly 0
    expected = []
    for g in groups:
        mean = sum(g) / len(g)
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / len(g))
        expected.append([(x - mean) / (std + 1e-6) if normalize_std else x - mean for x in g])
    got = alg.grpo_advantages(_t(groups), normalize_std)
    torch.testing.assert_close(got, _t(expected), rtol=0, atol=1e-12)
    # GSPO uses GRPO's advantages
    torch.testing.assert_close(alg.sample_advantages("gspo", _t(groups), normalize_std), got)


def test_grpo_singleton_groups_are_zero_not_nan() -> None:
    got = alg.grpo_advantages(_t([[0.3], [1.0]]), normalize_std=True)
    assert got.tolist() == [[0.0], [0.0]]


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
    ("sequence", "token_mean", False),
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
@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean"])
def test_gspo_gradient_is_the_analytic_per_token_gradient(seed: int, reduction: str) -> None:
    """d loss / d logp_t = -A_i s_i w_t [sequence i not clipped] / normaliser_t, with IS weights w_t."""
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
        norm = b.global_tokens() if reduction == "token_mean" else n * b.global_seqs()
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
@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean"])
def test_kl_loss_and_entropy_bonus(seed: int, reduction: str) -> None:
    b = _make_batch(seed)
    rows, length = b.shape
    ref = b.old_logp  # any second set of logprobs
    entropy = [[abs(x) for x in row] for row in b.adv_token]
    kl = [[_ref_kl(b.logp[r][t], ref[r][t], "low_var_kl") for t in range(length)] for r in range(rows)]
    gt, gs, seqs = b.global_tokens(), b.global_seqs(), b.sequences()
    kw = {"reduction": reduction, "global_seqs": gs, "seq_index_BS": torch.tensor(b.ids)}
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
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masked_is(seed: int, level: str) -> None:
    b = _make_batch(seed)
    train, rollout, m = b.logp, b.old_logp, b.mask
    low, high = (0.7, 1.4) if level == "token" else (0.85, 1.15)
    expected = [row[:] for row in m]
    if level == "token":
        for r in range(len(m)):
            for t in range(len(m[0])):
                if not low <= math.exp(train[r][t] - rollout[r][t]) <= high:
                    expected[r][t] = 0.0
    else:
        for seq in b.sequences():
            n = sum(m[r][t] for r, t in seq)
            mean = sum(m[r][t] * (train[r][t] - rollout[r][t]) for r, t in seq) / max(n, 1.0)
            if not low <= math.exp(mean) <= high:
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
