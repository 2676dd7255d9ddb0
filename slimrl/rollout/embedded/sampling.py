"""Per-request sampling parameters and the batched sampler of one decode step.

Logprob contract (the number RL trains against as the behaviour policy): the logprob reported for
a token is its log-probability under `log_softmax(logits / T)` of the very forward pass that
sampled it, with T = 1 for greedy requests, taken **before** top-k / top-p / min-p truncation and
before `min_new_tokens` suppression. The truncations only restrict which tokens may be drawn; they
do not renormalise the reported number. This equals what a trainer recomputes with a plain
log-softmax at the same temperature, and SGLang's default (`SGLANG_RETURN_ORIGINAL_LOGPROB` unset)
for requests without truncation.

Sampling draws one uniform number per request per step from the request's own `torch.Generator`
(seeded by `sampling_seed`) and inverts the CDF of the truncated distribution over tokens in a
stable order, so a seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GREEDY_TEMPERATURE = 1e-6
"""SGLang treats temperatures below this as greedy (temperature 1, top-k 1)."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """The subset of SGLang's `sampling_params` the embedded engine implements."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or any value >= the vocabulary) means all tokens."""
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    """As SGLang: disables EOS *and* `stop_token_ids`; stop strings still apply."""
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    extra: dict[str, object] = field(default_factory=dict, compare=False)
    """Accepted SGLang keys that do not change sampling here (e.g. spaces_between_special_tokens)."""

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def effective_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field."""
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 0, "must be >= 0"),
            ("min_new_tokens", self.min_new_tokens >= 0, "must be >= 0"),
            ("temperature", self.temperature >= 0.0, "must be >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, "must be -1 (all) or >= 1"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"sampling_params.{name}: {why}, got {getattr(self, name)!r}")
        for token in self.stop_token_ids:
            if token < 0:
                raise ValueError(f"sampling_params.stop_token_ids: negative token id {token}")
        if any(s == "" for s in self.stop):
            raise ValueError("sampling_params.stop: empty stop string")


@dataclass
class StepSample:
    """What one decode step decided for its batch."""

    tokens: list[int]
    logprobs: list[float]
    distributions: torch.Tensor
    """[B, V] log_softmax(logits / T): the distributions the logprobs were read from."""


def sample_step(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    suppressed: list[tuple[int, ...]],
) -> StepSample:
    """Pick one token per row of `logits` [B, V] (float32).

    `suppressed[i]` lists token ids row i may not draw this step (EOS before `min_new_tokens`).
    """
    temps = torch.tensor([p.effective_temperature for p in params], dtype=logits.dtype)
    dists = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens: list[int] = [0] * len(params)
    plain: list[int] = []  # rows drawn from the whole distribution: drawn together below
    for row, (p, gen, banned) in enumerate(zip(params, generators, suppressed, strict=True)):
        if p.greedy:
            scores = logits[row]
            if banned:
                scores = scores.clone()
                scores[list(banned)] = float("-inf")
            tokens[row] = int(torch.argmax(scores))
        elif banned or _truncates(p, dists.shape[-1]):
            tokens[row] = _draw(dists[row], p, gen, banned)
        else:
            plain.append(row)
    if plain:
        drawn = _draw_untruncated(dists[plain], [generators[row] for row in plain])
        for row, token in zip(plain, drawn, strict=True):
            tokens[row] = token
    logprobs = dists[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    return StepSample(tokens=tokens, logprobs=logprobs, distributions=dists)


def _truncates(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def _draw_untruncated(logprobs: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
    """`_draw` for rows without truncation or banned tokens, all rows at once: the same uniform
    from each row's generator, the same stable descending order, cumulative sums and search."""
    u = torch.tensor([float(torch.rand((), generator=g, dtype=torch.float64)) for g in generators])
    probs = logprobs.to(torch.float64).exp()
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cdf = torch.cumsum(sorted_p, dim=-1)
    pos = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    last_kept = (sorted_p > 0).sum(dim=-1) - 1  # sorted descending: the kept tokens lead
    return order.gather(1, torch.minimum(pos, last_kept).unsqueeze(1)).squeeze(1).tolist()


def _draw(logprobs: torch.Tensor, p: SamplingParams, gen: torch.Generator, banned: tuple[int, ...]) -> int:
    """Inverse-CDF draw from the truncated distribution (one uniform from the request's generator)."""
    u = float(torch.rand((), generator=gen, dtype=torch.float64))
    probs = logprobs.to(torch.float64).exp()
    if banned:
        probs[list(banned)] = 0.0
    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    keep = sorted_p > 0
    if 0 < p.top_k < sorted_p.numel():
        keep[p.top_k :] = False
    if p.top_p < 1.0:
        before = torch.cumsum(sorted_p, 0) - sorted_p
        keep &= before <= p.top_p * sorted_p.sum()  # as SGLang: drop where the mass before > top_p
    if p.min_p > 0.0:
        keep &= sorted_p >= p.min_p * sorted_p[0]
    keep[0] = keep[0] or bool(sorted_p[0] > 0)
    weights = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    cdf = torch.cumsum(weights, 0)
    pos = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    last_kept = int(keep.nonzero()[-1])
    return int(order[min(pos, last_kept)])
