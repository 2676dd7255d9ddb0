"""SFT on whole conversations (multi-turn, tool calls): the chat template's tokens, trained on the
assistant turns only; the data checks that let such rows in; `slimrl train` on them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slimrl.data.prompts import PromptRecord, check_prompt_file
from slimrl.data.sft import sft_sample
from slimrl.data.toy_tasks import make_data
from slimrl.errors import ConfigError, SlimError
from tests.conftest import REPO, run_slimrl

os.environ["HF_HUB_OFFLINE"] = "1"

A, B = 59, 63
TOOLS_TEXT = (
    '{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": '
    '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, '
    '"required": ["a", "b"]}}}'
)
CALL_TEXT = f'<tool_call>\n{{"name": "add", "arguments": {{"a": {A}, "b": {B}}}}}\n</tool_call><|im_end|>'
"""The assistant's first turn as Qwen2.5's tool format writes it (written out by hand)."""


def _record(answer: str = "2") -> PromptRecord:
    from examples import openai_agent

    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "add", "arguments": json.dumps({"a": A, "b": B})},
    }
    messages = [
        {"role": "user", "content": f"{A}+{B}="},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": str(A + B)},
        {"role": "assistant", "content": answer},
    ]
    return PromptRecord(prompt=messages, label=None, metadata={}, tools=openai_agent.TOOLS)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model("qwen3_moe"))


def test_a_conversation_trains_exactly_its_assistant_turns(tokenizer) -> None:
    sample = sft_sample(tokenizer, _record("2"), apply_chat_template=True)
    whole = (
        f"<|im_start|>system\n<tools>\n{TOOLS_TEXT}\n</tools><|im_end|>\n<|im_start|>user\n{A}+{B}=<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL_TEXT}\n<|im_start|>user\n<tool_response>\n{A + B}\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n2<|im_end|>"
    )  # the template's text, written out by hand, ending with the last turn's end token
    assert tokenizer.decode(sample.tokens) == whole
    response = sample.tokens[-sample.response_length :]
    assert tokenizer.decode(response).startswith("<tool_call>")
    trained = "".join(tokenizer.decode([t]) for t, m in zip(response, sample.loss_mask, strict=True) if m)
    assert trained == CALL_TEXT + "2<|im_end|>"
    between = (
        f"\n<|im_start|>user\n<tool_response>\n{A + B}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert sample.loss_mask[-2:] == [1, 1] and sample.loss_mask.count(0) == len(tokenizer.encode(between))


def test_a_prompt_record_still_trains_its_label(tokenizer) -> None:
    record = PromptRecord(prompt=[{"role": "user", "content": "1+2="}], label="3", metadata={})
    sample = sft_sample(tokenizer, record, apply_chat_template=True)
    assert tokenizer.decode(sample.tokens[-sample.response_length :]) == "3<|im_end|>"
    assert sample.loss_mask == [1, 1]


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer) -> None:
    import copy

    counting = copy.deepcopy(tokenizer)  # the number of messages first: every earlier render differs
    counting.chat_template = (
        "{{ messages|length }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(SlimError, match=r"renders messages\[:1\] differently"):
        sft_sample(counting, _record(), apply_chat_template=True)


def _rows(tmp_path: Path, *rows: dict) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_data_check_lets_conversations_in_without_labels_for_sft_only(tmp_path: Path) -> None:
    conversation = {"prompt": _record().prompt, "tools": _record().tools}
    path = _rows(tmp_path, conversation)
    check_prompt_file(path, "data.prompt_data", "prompt", "label", "SFT trains on it", True, sft=True)
    with pytest.raises(ConfigError, match=r"data.label_key=label: .* has no `label`"):
        check_prompt_file(path, "data.prompt_data", "prompt", "label", "the reward scores against it", True)
    bad_tools = _rows(tmp_path, {**conversation, "tools": "add"})
    with pytest.raises(ConfigError, match=r"data.tools_key=tools: .*record 1: `tools` is not a list"):
        check_prompt_file(
            bad_tools, "data.prompt_data", "prompt", "label", "SFT trains on it", True, sft=True
        )
    no_content = _rows(tmp_path, {"prompt": [{"role": "user"}]})
    with pytest.raises(ConfigError, match="not of chat messages"):
        check_prompt_file(no_content, "data.prompt_data", "prompt", None, "", True)


_REPLIES = (
    {"role": "assistant", "content": "7"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {}}}],
    },
)


def _template_ids(tokenizer, reply: dict) -> list[int]:
    """transformers' own rendering of a tool_sum_sft conversation, up to the reply's end token."""
    from slimrl.data.toy_tasks import CALCULATOR_TOOL

    messages = [{"role": "user", "content": "12+34="}, reply]
    ids = tokenizer.apply_chat_template(messages, tools=[CALCULATOR_TOOL], tokenize=True, return_dict=False)
    return list(ids)[: len(ids) - list(reversed(ids)).index(tokenizer.eos_token_id)]


@pytest.mark.slow
def test_slimrl_train_sft_on_tool_conversations(tmp_path: Path, tiny_model, tokenizer) -> None:
    """The tool-use SFT config on `make-data --task tool_sum_sft` rows (no label needed): two
    Megatron ranks (EP2) train on the assistant turns; the loss falls from ln(vocab)."""
    data = make_data("tool_sum_sft", tmp_path / "conversations.jsonl", num_samples=256, seed=0)
    steps = 15
    proc = run_slimrl(
        "train",
        str(REPO / "configs" / "tiny_moe_tool_sft_cpu.yaml"),
        f"model.hf_checkpoint={tiny_model('qwen3_moe')}",
        f"data.prompt_data={data}",
        f"run.runs_dir={tmp_path}",
        "run.name=sft",
        f"train.num_steps={steps}",
        "logging.tensorboard=false",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # 32 conversations per step, each as long as transformers renders it through the last end
    # token: a guess or a tool call, nothing cut or padded in
    guess, call = (len(_template_ids(tokenizer, reply)) for reply in _REPLIES)
    for row in rows:
        calls, rest = divmod(row["tokens"] - 32 * guess, call - guess)
        assert rest == 0 and 0 < calls < 32, row["tokens"]
    assert rows[0]["loss"] > 4.0 and rows[-1]["loss"] < rows[0]["loss"] - 2.0  # measured: 4.66 -> 1.54
