"""Supervised fine-tuning samples.

A prompt record trains on its label: the prompt is context, the label (+ EOS) is trained on. A
record whose messages end with an assistant turn is a whole conversation (multi-turn, tool calls):
the chat template renders it once, with the row's tools, and every assistant turn is trained on
(its content or tool calls and the token that ends the turn), everything else (system, user, tool
results, the template's text between turns) is context. The tokens are exactly those an agent's
conversation has at rollout time through the endpoint, so an SFT warm start and the RL that follows
train the same sequences.
"""

from __future__ import annotations

from typing import Any

from slimrl.data.prompts import PromptRecord, chat_text, is_conversation, render_prompt, text_ids
from slimrl.errors import SlimError
from slimrl.sample import Sample, Status


def sft_sample(tokenizer: Any, record: PromptRecord, apply_chat_template: bool, index: int = 0) -> Sample:
    if is_conversation(record.prompt):
        return conversation_sample(tokenizer, record, index)
    prompt_ids = render_prompt(tokenizer, record.prompt, apply_chat_template, record.tools)
    response_ids = [*tokenizer.encode(str(record.label), add_special_tokens=False), tokenizer.eos_token_id]
    return Sample(
        index=index,
        prompt=record.prompt,
        tokens=prompt_ids + response_ids,
        response=str(record.label),
        response_length=len(response_ids),
        label=record.label,
        loss_mask=[1] * len(response_ids),
        status=Status.COMPLETED,
        metadata=record.metadata,
    )


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, generation_prompt: bool) -> list[int]:
    return text_ids(tokenizer, chat_text(tokenizer, messages, tools, generation_prompt))


def assistant_spans(
    tokenizer: Any, messages: list[dict[str, Any]], tools: Any
) -> tuple[list[int], list[range]]:
    """The conversation's token ids and, per assistant turn, the positions trained on: from the end
    of the generation prompt before it through the turn's end token (EOS), not the template's text
    after it (`\\n`), which the model never samples. Refuses a template that renders an earlier part
    of the conversation differently once it goes on (the spans would not be the sampled tokens)."""
    ids = _render(tokenizer, messages, tools, False)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        head = _render(tokenizer, messages[:i], tools, True)
        through = _render(tokenizer, messages[: i + 1], tools, False)
        if ids[: len(head)] != head or ids[: len(through)] != through:
            raise SlimError(
                f"SFT conversation: the chat template renders messages[:{i}] differently once the "
                "conversation goes on, so its assistant turns have no fixed tokens to train on"
            )
        turn = through[len(head) :]
        ends = [j for j, token in enumerate(turn) if token == tokenizer.eos_token_id]
        stop = len(head) + (ends[-1] + 1 if ends else len(turn))
        spans.append(range(len(head), stop))
    return ids, spans


def conversation_sample(tokenizer: Any, record: PromptRecord, index: int = 0) -> Sample:
    """A whole conversation: the response runs from the first assistant turn through the last
    one's end token (the template's text after it is dropped: an agent's sample ends there too),
    trained on the assistant turns only."""
    messages = record.prompt
    assert isinstance(messages, list)
    ids, spans = assistant_spans(tokenizer, messages, record.tools)
    ids = ids[: spans[-1].stop]
    start = spans[0].start
    loss_mask = [0] * (len(ids) - start)
    for span in spans:
        for position in span:
            loss_mask[position - start] = 1
    return Sample(
        index=index,
        prompt=messages,
        tokens=ids,
        response=tokenizer.decode(ids[start:]),
        response_length=len(ids) - start,
        label=record.label,
        loss_mask=loss_mask,
        status=Status.COMPLETED,
        metadata=record.metadata,
    )
