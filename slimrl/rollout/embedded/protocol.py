"""SGLang's `/generate` JSON contract: request parsing/validation and response shapes.

Parsing is strict where SGLang 0.5.23's contract is strict and lenient where it is lenient:

* unknown **top-level** keys are ignored (routers add `model`, `stream: false`, `log_metrics`, ...);
* unknown or ill-typed keys **inside `sampling_params`** are a 400 naming the key;
* options the embedded engine does not implement (streaming, penalties, constrained
  decoding, n > 1, ...) are accepted at their default value and refused otherwise, by name, rather
  than silently ignored.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from slimrl.rollout.embedded.engine import GenerateRequest, GenerateResult, RequestError
from slimrl.rollout.embedded.sampling import SamplingParams

_INT, _FLOAT, _BOOL, _STR = "an integer", "a number", "a boolean", "a string"
_STRS, _INTS, _DICT = "a string or a list of strings", "a list of integers", "an object"

_IMPLEMENTED: dict[str, str] = {
    "max_new_tokens": _INT,
    "min_new_tokens": _INT,
    "temperature": _FLOAT,
    "top_p": _FLOAT,
    "top_k": _INT,
    "min_p": _FLOAT,
    "stop": _STRS,
    "stop_token_ids": _INTS,
    "ignore_eos": _BOOL,
    "no_stop_trim": _BOOL,
    "skip_special_tokens": _BOOL,
    "sampling_seed": _INT,
}

_ACCEPTED_NOOP: dict[str, str] = {
    "spaces_between_special_tokens": _BOOL,  # detokenization detail of multi-char special tokens
    "custom_params": _DICT,  # input of custom logit processors, which this engine has none of
    "stream_interval": _INT,
}
"""Keys that cannot change what this engine generates; accepted with any well-typed value."""

_DEFAULT_ONLY: dict[str, tuple[str, Any]] = {
    "n": (_INT, 1),
    "frequency_penalty": (_FLOAT, 0.0),
    "presence_penalty": (_FLOAT, 0.0),
    "repetition_penalty": (_FLOAT, 1.0),
    "stop_regex": (_STRS, None),
    "json_schema": (_STR, None),
    "regex": (_STR, None),
    "ebnf": (_STR, None),
    "structural_tag": (_STR, None),
    "logit_bias": (_DICT, {}),
}
"""SGLang keys the embedded engine does not implement: only their default value is accepted."""

_ALL_KEYS = (*_IMPLEMENTED, *_ACCEPTED_NOOP, *_DEFAULT_ONLY)

_TOP_LEVEL_DEFAULT_ONLY: dict[str, Any] = {
    "stream": False,
    "token_ids_logprob": None,
    "return_hidden_states": False,
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "lora_path": None,
    "session_params": None,
    "custom_logit_processor": None,
}


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, str):
        return f"string {json.dumps(value)[:60]}"
    if isinstance(value, int | float):
        return f"number {value}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _type_ok(value: Any, kind: str) -> bool:
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _FLOAT:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == _STR:
        return isinstance(value, str)
    if kind == _STRS:
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    if kind == _INTS:
        return isinstance(value, list) and all(_type_ok(v, _INT) for v in value)
    if kind == _DICT:
        return isinstance(value, dict)
    raise AssertionError(kind)


def parse_sampling_params(raw: Any, where: str = "sampling_params") -> SamplingParams:
    """SGLang `sampling_params` dict -> SamplingParams (RequestError naming the key on failure)."""
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise RequestError(f"{where}: invalid type: {_describe(raw)}, expected an object")
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in _ALL_KEYS:
            raise RequestError(f"{where}: unknown field `{key}`, expected one of {', '.join(_ALL_KEYS)}")
        if value is None:
            continue  # null means "default", as in SGLang's contract
        kind = _IMPLEMENTED.get(key) or _ACCEPTED_NOOP.get(key) or _DEFAULT_ONLY[key][0]
        if not _type_ok(value, kind):
            raise RequestError(f"{where}.{key}: invalid type: {_describe(value)}, expected {kind}")
        if key in _DEFAULT_ONLY and value != _DEFAULT_ONLY[key][1]:
            raise RequestError(f"{where}.{key}={json.dumps(value)}: not supported by the embedded engine")
        if key in _ACCEPTED_NOOP or key in _DEFAULT_ONLY:
            extra[key] = value
            continue
        if key == "stop":
            value = (value,) if isinstance(value, str) else tuple(value)
        elif key == "stop_token_ids":
            value = tuple(value)
        elif kind == _FLOAT:
            value = float(value)
        values[key] = value
    params = SamplingParams(**values, extra=extra)
    try:
        params.validate()
    except ValueError as exc:
        raise RequestError(str(exc).replace("sampling_params", where, 1)) from None
    return params


@dataclass(frozen=True)
class ParsedGenerate:
    """A `/generate` body: one request per batch item, and whether the caller sent a batch."""

    requests: list[GenerateRequest]
    is_batch: bool
    return_text_in_logprobs: bool
    return_prompt_token_ids: bool


def _per_item(body: dict, key: str, n: int, is_batch: bool, kind: str, default: Any) -> list[Any]:
    """A field that is a scalar (shared) or, for batches, a list with one entry per item."""
    value = body.get(key)
    if value is None:
        return [default] * n
    if is_batch and isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{key}: list has {len(value)} entries for a batch of {n}")
        items = value
    else:
        items = [value] * n
    for item in items:
        if item is not None and not _type_ok(item, kind):
            raise RequestError(f"{key}: invalid type: {_describe(item)}, expected {kind}")
    return [default if item is None else item for item in items]


def _prompts(body: dict, tokenizer: Any) -> tuple[list[list[int]], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("exactly one of `text` and `input_ids` is required")
    if ids is not None:
        if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
            for item in ids:
                if not _type_ok(item, _INTS):
                    raise RequestError(f"input_ids: invalid type: {_describe(item)}, expected {_INTS}")
            return [list(x) for x in ids], True
        if not _type_ok(ids, _INTS):
            raise RequestError(f"input_ids: expected {_INTS} or a list of them")
        if not ids:
            raise RequestError("input_ids is empty")
        return [list(ids)], False
    if isinstance(text, str):
        return [tokenizer.encode(text)], False
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return [tokenizer.encode(t) for t in text], True
    raise RequestError("text: expected a string or a non-empty list of strings")


def parse_generate(body: Any, tokenizer: Any) -> ParsedGenerate:
    """Validate a `/generate` body (already JSON-decoded) into engine requests."""
    if not isinstance(body, dict):
        raise RequestError(f"request body: invalid type: {_describe(body)}, expected an object")
    for key, default in _TOP_LEVEL_DEFAULT_ONLY.items():
        value = body.get(key)
        per_item_default = isinstance(value, list) and all(v in (None, default) for v in value)
        if value is not None and value != default and not per_item_default:
            raise RequestError(f"{key}={json.dumps(value)[:60]}: not supported by the embedded engine")
    prompts, is_batch = _prompts(body, tokenizer)
    n = len(prompts)
    raw_params = body.get("sampling_params")
    if isinstance(raw_params, list):
        if not is_batch or len(raw_params) != n:
            raise RequestError(f"sampling_params: list has {len(raw_params)} entries for {n} prompt(s)")
        params = [parse_sampling_params(p, f"sampling_params[{i}]") for i, p in enumerate(raw_params)]
    else:
        params = [parse_sampling_params(raw_params)] * n
    rids = body.get("rid")
    if rids is None:
        import uuid

        rid_list = [uuid.uuid4().hex for _ in range(n)]
    elif is_batch:
        if not (isinstance(rids, list) and len(rids) == n and all(isinstance(r, str) for r in rids)):
            raise RequestError(f"rid: a batch needs a list of {n} strings")
        if len(set(rids)) != n:
            raise RequestError("rid: ids must be unique within a batch")
        rid_list = list(rids)
    elif isinstance(rids, str):
        rid_list = [rids]
    else:
        raise RequestError(f"rid: invalid type: {_describe(rids)}, expected a string")
    return_logprob = _per_item(body, "return_logprob", n, is_batch, _BOOL, False)
    start_len = _per_item(body, "logprob_start_len", n, is_batch, _INT, -1)
    routed = _per_item(body, "return_routed_experts", n, is_batch, _BOOL, False)
    routed_start = _per_item(body, "routed_experts_start_len", n, is_batch, _INT, 0)
    top_logprobs = _per_item(body, "top_logprobs_num", n, is_batch, _INT, 0)
    flags = {}
    for key in ("return_text_in_logprobs", "return_prompt_token_ids"):
        value = body.get(key)
        if value is not None and not isinstance(value, bool):
            raise RequestError(f"{key}: invalid type: {_describe(value)}, expected {_BOOL}")
        flags[key] = bool(value)
    requests = [
        GenerateRequest(
            input_ids=prompts[i],
            sampling=params[i],
            rid=rid_list[i],
            return_logprob=return_logprob[i],
            logprob_start_len=start_len[i],
            return_routed_experts=routed[i],
            routed_experts_start_len=routed_start[i],
            top_logprobs_num=max(top_logprobs[i], 0),
        )
        for i in range(n)
    ]
    return ParsedGenerate(
        requests, is_batch, flags["return_text_in_logprobs"], flags["return_prompt_token_ids"]
    )


def _triples(values: list[float | None], ids: list[int], tokenizer: Any, with_text: bool) -> list[list[Any]]:
    return [
        [value, token, tokenizer.decode([token]) if with_text else None]
        for value, token in zip(values, ids, strict=True)
    ]


def encode_routed_experts(rows: Any) -> str:
    """SGLang's wire form: base64 of the little-endian int32 array [tokens, layers, top_k]."""
    return base64.b64encode(rows.numpy().astype("<i4", copy=False).tobytes()).decode("ascii")


def generate_response(
    result: GenerateResult, request: GenerateRequest, parsed: ParsedGenerate, tokenizer: Any
) -> dict[str, Any]:
    """One item of SGLang's non-streaming `/generate` response."""
    spans = result.weight_versions
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": len(result.prompt_ids),
        "completion_tokens": result.completion_tokens,
        "cached_tokens": 0,
        "weight_version": spans[-1]["version"] if spans else result.weight_version,  # as SGLang
        "weight_versions": spans,
        "num_retractions": result.num_retractions,
        "e2e_latency": result.e2e_latency,
    }
    if request.return_logprob:
        with_text = parsed.return_text_in_logprobs
        meta["output_token_logprobs"] = _triples(
            list(result.output_token_logprobs), result.generated_ids, tokenizer, with_text
        )
        meta["input_token_logprobs"] = (
            _triples(result.input_token_logprobs, result.input_token_ids, tokenizer, with_text)
            if result.input_token_logprobs is not None
            else []
        )
        meta["output_token_logprobs_length"] = len(result.generated_ids)
        if result.output_top_logprobs is not None:
            meta["input_top_logprobs"] = []
            meta["output_top_logprobs"] = [
                [[value, token, tokenizer.decode([token]) if with_text else None] for value, token in row]
                for row in result.output_top_logprobs
            ]
        if result.decode_logprob_max_abs_diff is not None:
            meta["decode_logprob_max_abs_diff"] = result.decode_logprob_max_abs_diff
    if request.return_routed_experts and result.routed_experts is not None:
        meta["routed_experts"] = encode_routed_experts(result.routed_experts)
        meta["routed_experts_start_len"] = request.routed_experts_start_len
    item: dict[str, Any] = {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}
    if parsed.return_prompt_token_ids:
        item["prompt_token_ids"] = result.prompt_ids
    return item
