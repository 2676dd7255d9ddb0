"""Supervised fine-tuning samples: the prompt is context, the label (+ EOS) is trained on."""

from __future__ import annotations

from typing import Any

from slimrl.data.prompts import PromptRecord, render_prompt
from slimrl.sample import Sample, Status


def sft_sample(tokenizer: Any, record: PromptRecord, apply_chat_template: bool, index: int = 0) -> Sample:
    prompt_ids = render_prompt(tokenizer, record.prompt, apply_chat_template)
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
