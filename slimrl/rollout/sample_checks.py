"""What a user's hook returns is checked where it enters slimrl, not where torch trips over it.

A `generate()` or rollout function hands back `Sample`s the trainer will turn into tensors. A
string token, a length that does not fit, or an id outside the vocabulary would otherwise
surface minutes later as an index error deep inside Megatron; here each gives one line naming the
hook's config key, the sample and the field.

**Decision** (issue 13): a sample returned with `status` still `pending` is an error, not a guess
from the engine's finish reason: the hook may have made several engine calls, or none, and only
it knows whether the response is complete. The built-in `generate` sets it from `finish_reason`.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import numpy as np

from slimrl.errors import SlimError
from slimrl.rollout.routing import RoutingLayout
from slimrl.sample import Sample, Status, invalid_expert_id
from slimrl.sampled import check_routing_rows

GENERATE_KEY = "rollout.custom_generate_function_path"
ROLLOUT_KEY = "rollout.rollout_function_path"
AGENT_KEY = "rollout.agent_function_path"
_SET_BY_HOOK = (Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED)


@lru_cache(maxsize=8)
def model_vocab_size(hf_checkpoint: str) -> int | None:
    """Rows of the model's embedding: every token id must be below it (None: not stated)."""
    try:
        config = json.loads((Path(hf_checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return int(size) if isinstance(size, int) else None


def check_sample(
    sample: Sample,
    hook: str,
    vocab_size: int | None,
    allow_pending: bool = False,
    routing: RoutingLayout | None = None,
    max_seq_len: int | None = None,
) -> None:
    """Raise one line if `sample` cannot be trained on; normalise what is merely loosely typed
    (numpy integers, a status given as its string value) in place. `allow_pending`: the rollout
    is aborting its requests, so an unfinished sample is expected (it is buffered or dropped).
    `routing` (routing replay on): a finished sample must carry that routing for every token.
    `max_seq_len` (`train.max_seq_len`, training rollouts): a finished sample fits in it."""

    def fail(field: str, problem: str) -> SlimError:
        return SlimError(f"{hook}: sample {sample.index}: {field} {problem}")

    sample.status = _status(sample.status, fail, allow_pending)
    sample.tokens = _token_ids(sample.tokens, vocab_size, fail)
    length = sample.response_length
    if not isinstance(length, Integral) or isinstance(length, bool) or not 0 <= length <= len(sample.tokens):
        raise fail(
            "response_length", f"is {length!r}; expected an int in [0, len(tokens)={len(sample.tokens)}]"
        )
    sample.response_length = n = int(length)
    finished = sample.status in (Status.COMPLETED, Status.TRUNCATED)
    if max_seq_len is not None and finished and len(sample.tokens) > max_seq_len:
        raise fail("tokens", _too_long(len(sample.tokens), n, max_seq_len, hook))
    if sample.loss_mask is not None:
        mask = _per_response_token(sample.loss_mask, "loss_mask", n, fail)
        if not all(m in (0, 1) for m in mask):
            raise fail("loss_mask", "must hold only 0 and 1")
        sample.loss_mask = [int(m) for m in mask]
    if sample.rollout_log_probs is not None:
        logps = _per_response_token(
            sample.rollout_log_probs, "rollout_log_probs", sample.response_length, fail
        )
        if not all(
            isinstance(v, Real) and not isinstance(v, bool) and v <= 1e-4 and math.isfinite(v) for v in logps
        ):
            raise fail("rollout_log_probs", "must be finite log-probabilities (floats <= 0)")
        sample.rollout_log_probs = [float(v) for v in logps]
    if routing is not None and finished:
        sample.rollout_routed_experts = _routing(sample, hook, routing)


def _too_long(length: int, response_length: int, max_seq_len: int, hook: str) -> str:
    """Why a sample longer than `train.max_seq_len` is refused rather than cut: the memory plan and
    micro-batching are sized by it, and cutting would train on a sequence the engine never saw."""
    fix = (
        "set data.max_prompt_tokens so prompt + rollout.sampling.max_new_tokens fits"
        if hook == "generate"
        else "make the hook stop its turns within it"
    )
    return (
        f"has {length} tokens ({length - response_length} prompt + {response_length} response), more "
        f"than train.max_seq_len={max_seq_len}; raise train.max_seq_len or {fix}"
    )


def _routing(sample: Sample, hook: str, layout: RoutingLayout) -> np.ndarray:
    """The sample's routing as `layout` says, or one line naming the sample and both shapes. An
    unfinished sample may lack rows (an aborted turn returns none; its continuation asks for them)."""
    who = f"{hook}: sample {sample.index} (group {sample.group_index}): rollout_routed_experts"
    expected = layout.shape(len(sample.tokens))
    if sample.rollout_routed_experts is None:
        raise SlimError(
            f"{who} is missing but algorithm.routing_replay=true: the engine returned no routed experts "
            "(an SGLang launched without --enable-return-routed-experts or too old to return them, or a "
            "hook that did not ask: pass **ctx.routing_request(sample) to ctx.client.generate)"
        )
    array = np.asarray(sample.rollout_routed_experts)
    if array.shape != expected or not np.issubdtype(array.dtype, np.integer):
        raise SlimError(
            f"{who} has shape {array.shape} ({array.dtype}); expected {expected} integers (len(tokens) - 1 "
            f"= {expected[0]}, MoE layers = {expected[1]}, top_k = {expected[2]})"
        )
    check_routing_rows(array, who)
    if (bad := invalid_expert_id(array, layout.num_experts)) is not None:
        raise SlimError(
            f"{who} holds expert id {bad}; the model has {layout.num_experts} experts "
            f"(ids 0..{layout.num_experts - 1})"
        )
    return array.astype(layout.dtype, copy=False)


def _status(status: Any, fail: Any, allow_pending: bool) -> Status:
    try:
        value = Status(status)
    except ValueError:
        raise fail(
            "status", f"is {status!r}; expected one of {', '.join(s.value for s in _SET_BY_HOOK)}"
        ) from None
    if value is Status.PENDING and not allow_pending:
        raise fail(
            "status",
            "is still pending: the hook must set it (completed, truncated, aborted or failed), e.g. "
            "from the engine's meta_info.finish_reason as slimrl.rollout.generate.generate does",
        )
    return value


def _token_ids(tokens: Any, vocab_size: int | None, fail: Any) -> list[int]:
    if not isinstance(tokens, list):
        raise fail("tokens", f"is a {type(tokens).__name__}; expected list[int]")
    if not all(type(t) is int for t in tokens):  # the common case is one fast pass
        bad = next((t for t in tokens if not isinstance(t, Integral) or isinstance(t, bool)), None)
        if bad is not None:
            raise fail("tokens", f"holds {bad!r} ({type(bad).__name__}); expected int token ids")
        tokens = [int(t) for t in tokens]
    if tokens:
        low, high = min(tokens), max(tokens)
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            culprit = low if low < 0 else high
            raise fail("tokens", f"holds id {culprit}, outside the model's vocabulary [0, {vocab_size})")
    return tokens


def _per_response_token(values: Any, field: str, response_length: int, fail: Any) -> list[Any]:
    if not isinstance(values, list):
        raise fail(field, f"is a {type(values).__name__}; expected a list, one entry per response token")
    if len(values) != response_length:
        raise fail(field, f"has {len(values)} entries; expected one per response token ({response_length})")
    return values
