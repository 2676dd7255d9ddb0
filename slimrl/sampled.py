"""Trained tokens are sampled tokens: digests taken where engine output enters a sample, checked
after every stage that could change it, and on the trainer rank that trains on it.

* `record_span` (called by `rollout.generate.apply_response`, the one place an engine turn is
  appended): the span of response positions the engine produced, its weight version(s) and a
  digest of its token ids, in `Sample.sampled_spans`.
* `check_sampled(sample, stage)`: every span's tokens are still the ones sampled, and every token
  trained on (loss mask 1) lies in a span; otherwise one line naming the sample, the positions
  and the stage that changed them. A sample without spans (a hook that built it without
  `apply_response`) carries no claim to check.
* `train_digest` of (tokens, loss mask, routing) is taken by the driver when it builds the
  trainer's batches and again by the trainer rank before it trains (`TrainBatch.digests`).
* `check_routing_rows`: a routing row that names one expert twice among a token's top-k (an
  all-zero or corrupted table) is refused, not replayed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from slimrl.errors import SlimError


def token_digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()[:16]


def record_span(sample: Any, start: int, ids: Sequence[int], versions: Sequence[str]) -> None:
    if ids:
        span = {
            "start": start,
            "end": start + len(ids),
            "digest": token_digest(ids),
            "versions": list(versions),
        }
        sample.sampled_spans.append(span)


def check_sampled(sample: Any, stage: str) -> None:
    spans = sample.sampled_spans
    if not spans:
        return
    response = sample.response_tokens
    who = f"{stage}: sample {sample.index} (group {sample.group_index})"
    for span in spans:
        start, end = span["start"], span["end"]
        if end > len(response) or token_digest(response[start:end]) != span["digest"]:
            raise SlimError(
                f"{who}: response tokens {start}-{end} are not the ones the engine sampled (weight "
                f"version {'/'.join(span['versions']) or '?'}): changed after sampling, by {stage}"
            )
    covered = np.zeros(len(response), dtype=bool)
    for span in spans:
        covered[span["start"] : span["end"]] = True
    trained = np.asarray(sample.effective_loss_mask(), dtype=bool)
    foreign = np.flatnonzero(trained & ~covered)
    if foreign.size:
        raise SlimError(
            f"{who}: {foreign.size} token(s) trained on were not sampled by an engine (first at response "
            f"position {int(foreign[0])}), added by {stage}: give tokens the engine did not sample "
            "loss_mask 0"
        )


def train_digest(tokens: Sequence[int], loss_mask: Sequence[int], routing: np.ndarray | None) -> str:
    digest = hashlib.sha256(np.asarray(tokens, dtype="<i8").tobytes())
    digest.update(np.asarray(loss_mask, dtype="<i1").tobytes())
    if routing is not None:
        digest.update(np.ascontiguousarray(routing, dtype="<i4").tobytes())
    return digest.hexdigest()[:16]


def check_routing_rows(routing: np.ndarray, who: str) -> None:
    """(tokens, layers, top_k): no token's top-k in a layer repeats an expert."""
    if routing.ndim != 3 or routing.shape[2] < 2 or not routing.size:
        return
    ordered = np.sort(routing, axis=2)
    repeats = np.argwhere((ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2))
    if repeats.size:
        token, layer = (int(v) for v in repeats[0])
        raise SlimError(
            f"{who}: routing row {token} repeats an expert in MoE layer {layer} "
            f"({routing[token, layer].tolist()}): an all-zero or corrupted routing table, not replayed"
        )
