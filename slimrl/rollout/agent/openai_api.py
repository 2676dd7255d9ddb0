"""The OpenAI API as the endpoint speaks it: requests read and checked field by field, replies and
errors in OpenAI's shapes (https://platform.openai.com/docs/api-reference/chat).

A request is refused with OpenAI's 400 shape `{"error": {"message", "type", "param", "code"}}` when
a field has the wrong type or range, when it names a parameter OpenAI does not have
("Unrecognized request argument supplied: X", as OpenAI words it), or when it asks for something
that would change what the policy samples from and that the endpoint therefore does not do
(penalties, logit bias, structured output): RL must train on the policy's own distribution.
Parameters that change nothing the engine does (`user`, `metadata`, `store`, ...) are accepted.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any


class ApiError(Exception):
    """An error reply in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, problem: str, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, f"Invalid value for '{param}': {problem}", param=param, code=code)


_IGNORED = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention",
     "safety_identifier", "parallel_tool_calls", "verbosity", "modalities", "reasoning_effort",
     "stream_options"}
)  # fmt: skip
"""Accepted and without effect on what is sampled (`stream_options` is read where streaming is)."""

_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}
"""Accepted only at the value that leaves the policy's distribution as it is."""

_CHAT = frozenset(
    {"messages", "model", "tools", "tool_choice", "n", "temperature", "top_p", "max_tokens",
     "max_completion_tokens", "stop", "logprobs", "top_logprobs", "stream", "seed"}
)  # fmt: skip
_COMPLETION = frozenset(
    {"prompt", "model", "n", "temperature", "top_p", "max_tokens", "stop", "logprobs", "stream", "seed"}
)  # fmt: skip
MAX_N = 128
MAX_TOP_LOGPROBS = 20
"""OpenAI's limit (the completions API's `logprobs` allows 5)."""


@dataclass
class Common:
    """What both endpoints read."""

    model: str
    n: int
    max_tokens: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    top_logprobs: int | None
    """None: no logprobs asked; 0: the sampled tokens' only; k: and the k most likely."""
    requested: dict[str, Any] = field(default_factory=dict)
    """The agent's temperature / top_p / seed: recorded, not applied (the rollout's sampling is)."""


@dataclass
class ChatRequest(Common):
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"


@dataclass
class CompletionRequest(Common):
    prompt: str | list[int] = ""


def _check_keys(body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    for key, value in body.items():
        if key in allowed or key in _IGNORED:
            continue
        if key in _NEUTRAL:
            if value not in _NEUTRAL[key]:
                raise bad(
                    key, f"only {_NEUTRAL[key][-1]!r} is supported: the policy is trained on what it samples"
                )
            continue
        raise ApiError(
            400, f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter"
        )
    return body


def _int(
    body: dict[str, Any], key: str, default: int | None, low: int, high: int | None = None
) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if type(value) is not int:
        raise bad(key, f"expected an integer, got {type(value).__name__}", "invalid_type")
    if value < low or (high is not None and value > high):
        limit = f"at least {low}" if high is None else f"between {low} and {high}"
        raise bad(key, f"{value} is not {limit}")
    return value


def _number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(key, "expected a finite number", "invalid_type")
    if not low <= value <= high:
        raise bad(key, f"{value} is not between {low:g} and {high:g}")
    return float(value)


def _bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(key, f"expected a boolean, got {type(value).__name__}", "invalid_type")
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise bad("stop", "expected a non-empty string or a list of up to 4 of them")
    return list(stops)


def _common(body: dict[str, Any], max_tokens_key: str) -> Common:
    model = body.get("model", "")
    if not isinstance(model, str):
        raise bad("model", "expected a string", "invalid_type")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad("stream_options", "expected an object", "invalid_type")
    requested = {}
    for key in ("temperature", "top_p"):
        value = _number(body, key, 0.0, 2.0 if key == "temperature" else 1.0)
        if value is not None:
            requested[key] = value
    if "seed" in body and body["seed"] is not None:
        requested["seed"] = _int(body, "seed", None, -(2**63))
    max_tokens = _int(body, "max_tokens", None, 1)
    if max_tokens_key != "max_tokens":
        max_tokens = _int(body, max_tokens_key, max_tokens, 1)
    return Common(
        model=model,
        n=_int(body, "n", 1, 1, MAX_N) or 1,
        max_tokens=max_tokens,
        stop=_stop(body),
        stream=_bool(body, "stream"),
        include_usage=bool((stream_options or {}).get("include_usage")),
        top_logprobs=None,
        requested=requested,
    )


def parse_chat(body: Any) -> ChatRequest:
    body = _check_keys(body, _CHAT)
    common = _common(body, "max_completion_tokens")
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if _bool(body, "logprobs"):
        common.top_logprobs = top or 0
    elif top:
        raise bad("top_logprobs", "needs logprobs: true")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "expected a non-empty array of messages", "invalid_type")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad("tools", "expected an array of tool objects", "invalid_type")
    tool_choice = body.get("tool_choice") or "auto"
    named = isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict)
    if tool_choice not in ("auto", "none", "required") and not named:
        raise bad(
            "tool_choice", "expected 'auto', 'none', 'required' or {'type': 'function', 'function': {...}}"
        )
    if tool_choice != "none" and tool_choice != "auto" and not tools:
        raise bad("tool_choice", "is only allowed when 'tools' are specified")
    return ChatRequest(**vars(common), messages=messages, tools=tools, tool_choice=tool_choice)


def parse_completion(body: Any) -> CompletionRequest:
    body = _check_keys(body, _COMPLETION)
    common = _common(body, "max_tokens")
    common.top_logprobs = _int(body, "logprobs", None, 0, 5)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    token_ids = isinstance(prompt, list) and all(type(t) is int and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not (token_ids and prompt):
        raise bad("prompt", "expected a non-empty string or array of token ids (one prompt per request)")
    return CompletionRequest(**vars(common), prompt=prompt)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def reply_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def chat_completion(model: str, choices: list[dict[str, Any]], used: dict[str, int]) -> dict[str, Any]:
    return {
        "id": reply_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": used,
        "system_fingerprint": None,
    }


def text_completion(model: str, choices: list[dict[str, Any]], used: dict[str, int]) -> dict[str, Any]:
    return {
        "id": reply_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": used,
        "system_fingerprint": None,
    }


def chat_stream(reply: dict[str, Any], include_usage: bool) -> list[str]:
    """A finished chat reply as the server-sent events of a stream: per choice the role, its content,
    its tool calls and its finish reason, then (asked with `stream_options.include_usage`) the usage,
    then `[DONE]`. The reply is generated whole before the first event (no token streaming)."""
    head = {k: reply[k] for k in ("id", "created", "model", "system_fingerprint")}
    head["object"] = "chat.completion.chunk"
    events = []
    for choice in reply["choices"]:
        message, index = choice["message"], choice["index"]
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        if message.get("content"):
            deltas.append({"content": message["content"]})
        for number, call in enumerate(message.get("tool_calls") or []):
            deltas.append({"tool_calls": [{"index": number, **call}]})
        for delta in deltas:
            events.append(
                {
                    **head,
                    "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}],
                }
            )
        last = {
            "index": index,
            "delta": {},
            "logprobs": choice["logprobs"],
            "finish_reason": choice["finish_reason"],
        }
        events.append({**head, "choices": [last]})
    if include_usage:
        events.append({**head, "choices": [], "usage": reply["usage"]})
    return [f"data: {json.dumps(event)}\n\n" for event in events] + ["data: [DONE]\n\n"]


def completion_stream(reply: dict[str, Any], include_usage: bool) -> list[str]:
    """A finished text completion as stream events (see `chat_stream`)."""
    head = {k: reply[k] for k in ("id", "object", "created", "model", "system_fingerprint")}
    events = [{**head, "choices": [choice]} for choice in reply["choices"]]
    if include_usage:
        events.append({**head, "choices": [], "usage": reply["usage"]})
    return [f"data: {json.dumps(event)}\n\n" for event in events] + ["data: [DONE]\n\n"]
