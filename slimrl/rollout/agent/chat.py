"""The chat side of the endpoint: the model's chat template applied once, by slimrl; the prompt of a
continued conversation built from the token ids the engine already sampled; tool calls parsed by
SGLang's own parsers (`sglang.srt.function_call`, imported on first use: SGLang imports torch).

**Continuing a conversation (token in).** When an agent sends back a conversation that extends an
earlier call of its session (that call's messages, then the assistant message the endpoint
returned, then anything new), the new prompt is that call's prompt ids + its completion ids as the
engine sampled them + the ids of only what is new: the rest of the template's closing of the
assistant turn (`<|im_end|>` was sampled, its `\\n` was not) and the new messages rendered by the
template, up to the generation prompt. The transcript is never re-tokenised, so the sampled tokens
stay in the sequence exactly and the next call's prompt extends the previous call's ids (the
trajectory then merges them into one training sequence). The new part is the template's own text:
the difference between the template applied to the whole conversation and to the part already
sampled. A template that re-renders earlier turns differently once the conversation goes on (some
reasoning templates drop old thinking) breaks that prefix; the endpoint then renders the whole
conversation afresh and the trajectory reports a split.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from typing import Any

from slimrl.data.prompts import chat_text, text_ids
from slimrl.rollout.agent.openai_api import ApiError, bad

logger = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")
_SENTINEL = "SLIMRL-SENTINEL-7f3a"
"""Stands in for an assistant turn's content to find the text the template closes that turn with."""


@functools.cache
def tool_call_parsers() -> frozenset[str]:
    """The names SGLang's `--tool-call-parser` accepts."""
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    return frozenset(FunctionCallParser.ToolCallParserEnum)


def _text(content: Any, where: str) -> str:
    """A message's content as one string: OpenAI's text parts joined; images and audio refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(where, f"content part of type {kind!r} is not supported (text only)")
        return "".join(parts)
    raise bad(where, "content must be a string or an array of text parts", "invalid_type")


def _arguments_key(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except ValueError:
        return arguments


def normalize_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """OpenAI messages in one canonical form: `role`, `content` as a string, `tool_calls` (with
    string arguments) on assistant turns, `tool_call_id` on tool turns, `name` when given."""
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, "expected a message object", "invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}")
        one: dict[str, Any] = {"role": "system" if role == "developer" else role}
        one["content"] = _text(message.get("content"), f"{where}.content")
        if isinstance(message.get("name"), str):
            one["name"] = message["name"]
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad(f"{where}.tool_call_id", "a tool message needs the id of the call it answers")
            one["tool_call_id"] = call_id
        if role == "assistant" and message.get("tool_calls"):
            one["tool_calls"] = [
                _tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(message["tool_calls"])
            ]
        out.append(one)
    return out


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad(where, "expected {'id', 'type': 'function', 'function': {'name', 'arguments'}}")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {
        "id": call.get("id") if isinstance(call.get("id"), str) else "",
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def message_key(message: dict[str, Any]) -> str:
    """What must match for a message the agent sends back to be one the session knows: role, content,
    name, tool-call id, and each tool call's name and arguments (as JSON values: whitespace and key
    order are the agent's business; call ids are not compared)."""
    calls = [
        (c["function"]["name"], _arguments_key(c["function"]["arguments"]))
        for c in message.get("tool_calls", [])
    ]
    fields = (message["role"], message["content"], message.get("name"), message.get("tool_call_id"), calls)
    return json.dumps(fields)


def tools_key(tools: list[dict[str, Any]]) -> str:
    return json.dumps(tools, sort_keys=True)


class ChatFormat:
    """One model's chat template and tool-call format."""

    def __init__(self, tokenizer: Any, tool_call_parser: str) -> None:
        self.tokenizer = tokenizer
        self.tool_call_parser = tool_call_parser
        self.turn_close = self._turn_close()
        """The text the template ends an assistant turn with (`<|im_end|>\\n`); None if not found."""

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], generation_prompt: bool
    ) -> str:
        try:
            return chat_text(self.tokenizer, messages, tools, generation_prompt)
        except Exception as exc:  # the template's own check (jinja's raise_exception) or a bad value
            raise ApiError(400, f"The chat template refused the messages: {exc}", param="messages") from None

    def encode(self, text: str) -> list[int]:
        return text_ids(self.tokenizer, text)

    def _turn_close(self) -> str | None:
        messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
        try:
            text = self.render(messages, [], False)
        except ApiError:
            return None
        at = text.find(_SENTINEL)
        return None if at < 0 else text[at + len(_SENTINEL) :]

    def continuation(
        self,
        sampled: list[dict[str, Any]],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        last_token: str | None,
    ) -> str | None:
        """The text to append to an earlier call's prompt + completion ids so they become the prompt
        of `messages`, whose first `len(sampled)` messages end with that call's assistant reply;
        `last_token`: the completion's stop token as text when it stopped on one. None when the
        template does not render `messages` as an extension of `sampled`."""
        if self.turn_close is None:
            return None
        head = self.render(sampled, tools, False)
        whole = self.render(messages, tools, True)
        if not whole.startswith(head):
            return None
        close = self.turn_close
        if last_token and close.startswith(last_token):
            close = close[len(last_token) :]
        return close + whole[len(head) :]

    def tools(self, tools: list[dict[str, Any]]) -> list[Any]:
        """The request's tools as SGLang's `Tool`s (its validation: a 400 naming the tool)."""
        from pydantic import ValidationError
        from sglang.srt.entrypoints.openai.protocol import Tool

        checked = []
        for i, tool in enumerate(tools):
            try:
                checked.append(Tool.model_validate(tool))
            except ValidationError as exc:
                problem = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
                raise bad(f"tools[{i}]", problem) from None
        return checked

    def parse_tool_calls(self, text: str, tools: list[Any]) -> tuple[str | None, list[dict[str, Any]], bool]:
        """(content, OpenAI `tool_calls`, malformed) from a completion's text, with SGLang's parser
        as its OpenAI server uses it (`serving_chat._process_tool_calls`): no marker, the text as it
        is; a marker without a complete call, the text before it, no calls, and malformed True."""
        from sglang.srt.function_call.function_call_parser import FunctionCallParser

        _quiet_parsers()
        parser = FunctionCallParser(tools, self.tool_call_parser, tokenizer=self.tokenizer)
        if not parser.has_tool_call(text):
            return text, [], False
        try:
            normal, calls = parser.parse_non_stream(text)
        except Exception as exc:  # SGLang logs and keeps the text
            logger.warning("tool-call parser %s failed: %s", self.tool_call_parser, exc)
            return text, [], True
        tool_calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call.name, "arguments": call.parameters},
            }
            for call in calls
        ]
        return (normal or None) if tool_calls else normal, tool_calls, not tool_calls


@functools.cache
def _quiet_parsers() -> None:
    """SGLang's tool-call parsers warn once per malformed call. A policy in training writes many
    (the tiny models' first calls, any model's exploration); each is recorded on its turn instead
    (`malformed_tool_call` in the sample log, `rollout/agent_malformed_tool_calls`)."""
    logging.getLogger("sglang.srt.function_call").setLevel(logging.ERROR)
