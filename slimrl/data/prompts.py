"""Prompt data sets: JSONL or Parquet rows with configurable keys, in a seeded epoch order."""

from __future__ import annotations

import copy
import itertools
import json
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimrl.errors import ConfigError, SlimError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    prompt: str | list[dict[str, Any]]
    label: Any
    metadata: dict[str, Any]
    tools: list[dict[str, Any]] | None = None
    """OpenAI function tools the chat template renders with the messages (`data.tools_key`)."""


def is_conversation(prompt: str | list[dict[str, Any]]) -> bool:
    """Chat messages that end with an assistant turn: a whole conversation to train on (SFT), not a
    prompt to answer."""
    return isinstance(prompt, list) and bool(prompt) and prompt[-1].get("role") == "assistant"


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: tool-call arguments as JSON objects where they parse
    (as SGLang passes them), strings otherwise."""
    out = copy.deepcopy(messages)
    for message in out:
        for call in message.get("tool_calls") or []:
            arguments = call.get("function", {}).get("arguments")
            if not isinstance(arguments, str):
                continue
            try:
                value = json.loads(arguments)
            except ValueError:
                continue
            if isinstance(value, dict):
                call["function"]["arguments"] = value
    return out


def chat_text(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, generation_prompt: bool) -> str:
    """The model's chat template applied to `messages` (and `tools`): the one rendering that RL
    prompts, SFT conversations and the agent endpoint share."""
    return tokenizer.apply_chat_template(
        for_template(messages), tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
    )


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered text (the template wrote the special tokens itself)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def iter_rows(path: str | Path) -> Iterator[dict[str, Any]]:
    """The rows of a JSONL (one JSON object per line) or Parquet file, read lazily."""
    path = Path(path)
    if not path.is_file():
        raise SlimError(f"{path}: prompt data file not found")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow's own errors: not a Parquet file, truncated, ...
            raise SlimError(f"{path}: not a readable Parquet file ({' '.join(str(exc).split())})") from None
        for batch in parquet.iter_batches(batch_size=256):
            yield from batch.to_pylist()
        return
    with path.open(errors="replace") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SlimError(
                    f"{path}:{line_no}: not valid JSON ({exc.msg}); expected JSONL, one JSON object per line"
                ) from None
            if not isinstance(row, dict):
                raise SlimError(
                    f"{path}:{line_no}: a JSON {type(row).__name__}, not an object; expected JSONL, one "
                    "JSON object per line"
                )
            yield row


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    return list(iter_rows(path))


FIRST_RECORDS = 8
"""Records `check_prompt_file` reads: enough to catch a wrong file or key, cheap at any size."""


def check_prompt_file(
    path: str | Path,
    key: str,
    input_key: str,
    label_key: str | None,
    label_why: str,
    chat_template: bool,
    *,
    tools_key: str = "tools",
    sft: bool = False,
) -> None:
    """Before anything starts: the file is a non-empty JSONL/Parquet data set whose first records
    hold `input_key` (a string, or chat messages with `chat_template`), when present `tools_key` (a
    list of tools) and, when given, `label_key` (except a whole conversation under `sft`: its
    assistant turns are what it trains on). Raises `ConfigError` naming the config `key`."""
    try:
        rows = list(itertools.islice(iter_rows(path), FIRST_RECORDS))
    except SlimError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if not rows:
        raise ConfigError(f"{key}={path}: holds no records (empty file)")
    for number, row in enumerate(rows, 1):
        where = f"{key}={path}: record {number}"
        if input_key not in row:
            keys = ", ".join(sorted(map(str, row))) or "none"
            raise ConfigError(
                f"data.input_key={input_key}: {key}={path}: record {number} has no `{input_key}` "
                f"(its keys: {keys})"
            )
        prompt = row[input_key]
        if isinstance(prompt, list) and not chat_template:
            raise ConfigError(
                f"{where}: `{input_key}` holds chat messages; they need data.apply_chat_template=true"
            )
        if isinstance(prompt, list):
            if not all(
                isinstance(m, dict) and "role" in m and ("content" in m or "tool_calls" in m) for m in prompt
            ):
                raise ConfigError(
                    f"{where}: `{input_key}` is a list but not of chat messages ({{role, content}} or "
                    "{role, tool_calls} objects)"
                )
        elif not isinstance(prompt, str):
            raise ConfigError(
                f"{where}: `{input_key}` is a {type(prompt).__name__}; expected a string or chat messages"
            )
        tools = row.get(tools_key)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ConfigError(
                f"data.tools_key={tools_key}: {where}: `{tools_key}` is not a list of OpenAI tool objects"
            )
        if sft and is_conversation(prompt):
            continue
        if label_key is not None and row.get(label_key) is None:
            keys = ", ".join(sorted(map(str, row)))
            raise ConfigError(
                f"data.label_key={label_key}: {key}={path}: record {number} has no `{label_key}` "
                f"({label_why}; its keys: {keys})"
            )


def load_prompts(
    path: str | Path,
    input_key: str = "prompt",
    label_key: str = "label",
    metadata_key: str = "metadata",
    tools_key: str = "tools",
) -> list[PromptRecord]:
    records = []
    for index, row in enumerate(read_rows(path)):
        if input_key not in row:
            keys = ", ".join(sorted(row)) or "none"
            raise SlimError(f"{path}: row {index} has no `{input_key}` (data.input_key); its keys: {keys}")
        records.append(
            PromptRecord(
                prompt=row[input_key],
                label=row.get(label_key),
                metadata=dict(row.get(metadata_key) or {}),
                tools=row.get(tools_key),
            )
        )
    if not records:
        raise SlimError(f"{path}: no rows")
    return records


def render_prompt(
    tokenizer: Any,
    prompt: str | list[dict[str, Any]],
    apply_chat_template: bool,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    if apply_chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return text_ids(tokenizer, chat_text(tokenizer, messages, tools, True))
    if not isinstance(prompt, str):
        raise TypeError("chat-message prompts need data.apply_chat_template=true")
    return text_ids(tokenizer, prompt)


def drop_long_prompts(
    records: list[PromptRecord], tokenizer: Any, max_tokens: int | None, chat_template: bool, source: str = ""
) -> list[PromptRecord]:
    """The records whose rendered prompt has at most `max_tokens` tokens (`data.max_prompt_tokens`;
    None keeps all); logs how many were dropped, and refuses a data set left empty."""
    if max_tokens is None:
        return records
    kept = [
        r for r in records if len(render_prompt(tokenizer, r.prompt, chat_template, r.tools)) <= max_tokens
    ]
    dropped = len(records) - len(kept)
    where = f" of {source}" if source else ""
    if not kept:
        raise ConfigError(
            f"data.max_prompt_tokens={max_tokens}: every one of the {len(records)} prompts{where} is longer"
        )
    if dropped:
        logger.info(
            "data.max_prompt_tokens=%d: dropped %d of %d prompts%s", max_tokens, dropped, len(records), where
        )
    return kept


class EpochSampler:
    """Yields record indices forever, reshuffling every epoch; its position can be saved."""

    def __init__(self, size: int, seed: int, shuffle: bool = True) -> None:
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.offset = 0, 0

    def _order(self) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            order = self._order()
            chunk = order[self.offset : self.offset + n - len(out)]
            out.extend(chunk)
            self.offset += len(chunk)
            if self.offset >= self.size:
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = state["epoch"], state["offset"]

    def __iter__(self) -> Iterator[int]:
        while True:
            yield from self.take(1)
