"""A character-level Hugging Face fast tokenizer for tiny test models.

One id per character keeps toy tasks honest: "12+34=" is six tokens, a one-digit answer is one
token, and a random model's first sampled token can already be right. Built with `tokenizers`
and saved as tokenizer.json + tokenizer_config.json so `AutoTokenizer.from_pretrained(dir)`
loads it offline like any hub tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers

from slimrl.utils.fs import atomic_write_text

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOS_TOKEN = IM_END
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END)
"""Ids 0, 1, 2: specials come first so the pad id is 0 whatever the character set."""

CHARS: tuple[str, ...] = ("\n", *(chr(code) for code in range(0x20, 0x7F)))
"""Newline, then printable ASCII (space .. tilde) in code-point order: ids 3 .. 98."""

VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARS)
PAD_TOKEN_ID = SPECIAL_TOKENS.index(PAD_TOKEN)
IM_START_ID = SPECIAL_TOKENS.index(IM_START)
EOS_TOKEN_ID = SPECIAL_TOKENS.index(EOS_TOKEN)
UNKNOWN_CHAR_REPLACEMENT = "?"
"""Characters outside the vocabulary are encoded as "?" (visible) rather than silently dropped."""

MODEL_MAX_LENGTH = 512

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}"
    "{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}"
    "{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's ChatML layout, tools included, without its default system prompt (so a conversation
without tools renders exactly as plain ChatML): with `tools` a system turn lists their JSON schemas
in `<tools></tools>`; an assistant turn's tool calls are `<tool_call>\\n{"name": ..., "arguments":
...}\\n</tool_call>` (the format SGLang's `qwen25` tool-call parser reads, what
`rollout.agent_tool_call_parser` names by default), and tool results are a user turn of
`<tool_response>` blocks. Short on purpose: one character is one token and the model has 512
positions."""


def vocab() -> dict[str, int]:
    """Token -> id, in the fixed order specials then `CHARS`."""
    return {token: index for index, token in enumerate((*SPECIAL_TOKENS, *CHARS))}


def vocab_size() -> int:
    return VOCAB_SIZE


def build_tokenizer_object() -> Tokenizer:
    """The raw `tokenizers.Tokenizer`: a BPE model without merges splits text into single characters."""
    tokenizer = Tokenizer(models.BPE(vocab=vocab(), merges=[], unk_token=None))
    # Everything but newline and printable ASCII (must match `CHARS`).
    tokenizer.normalizer = normalizers.Replace(Regex(r"[^\n\x20-\x7e]"), UNKNOWN_CHAR_REPLACEMENT)
    # Without a decoder, `decode` would join tokens with spaces; Fuse concatenates them verbatim.
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json: the generic fast class, so transformers uses tokenizer.json as is."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MODEL_MAX_LENGTH,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        # transformers' cleanup would turn "a ." into "a." and break the exact round trip.
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(index): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for index, token in enumerate(SPECIAL_TOKENS)
        },
        "chat_template": CHAT_TEMPLATE,
    }


def build_char_tokenizer(out_dir: str | Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json into `out_dir` (created if missing)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "tokenizer.json", build_tokenizer_object().to_str(pretty=True) + "\n")
    atomic_write_text(out_dir / "tokenizer_config.json", json.dumps(tokenizer_config(), indent=2) + "\n")
    return out_dir
