"""The character-level tokenizer: one id per character, exact round trips, offline loading."""

import json
import os
import random
import string
from pathlib import Path

import pytest

from slimrl.data.tokenizer import (
    CHARS,
    EOS_TOKEN_ID,
    IM_START_ID,
    PAD_TOKEN_ID,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    build_char_tokenizer,
    vocab_size,
)

os.environ["HF_HUB_OFFLINE"] = "1"  # none of the imports above loads huggingface_hub

PRINTABLE = "".join(chr(code) for code in range(0x20, 0x7F)) + "\n"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def test_files_and_fast_class(tok_dir: Path, tok) -> None:
    assert sorted(p.name for p in tok_dir.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert tok.is_fast
    assert len(tok) == VOCAB_SIZE == vocab_size() == 99
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == PAD_TOKEN_ID == 0
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == EOS_TOKEN_ID == 2
    assert tok.convert_tokens_to_ids("<|im_start|>") == IM_START_ID == 1
    assert tok.bos_token is None


def test_vocab_order_is_fixed(tok) -> None:
    expected = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *CHARS))}
    assert tok.get_vocab() == expected
    assert set(PRINTABLE) == set(CHARS)


def test_build_is_byte_deterministic(tmp_path: Path) -> None:
    first, second = build_char_tokenizer(tmp_path / "a"), build_char_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()


def test_one_id_per_char_no_bos(tok) -> None:
    assert tok.encode("12+34=") == [tok.convert_tokens_to_ids(c) for c in "12+34="]
    assert len(tok("12+34=")["input_ids"]) == 6
    ids = tok.encode(PRINTABLE)
    assert len(ids) == len(PRINTABLE) and len(set(ids)) == len(PRINTABLE)
    assert all(len(SPECIAL_TOKENS) <= i < VOCAB_SIZE for i in ids)
    for digit in string.digits:
        assert len(tok.encode(digit)) == 1


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "  a  b  ",
        "a . b , c ! d ? e ' f",
        "don't , stop .",
        "x\n\ny\n",
        "rev 012=",
        '~!@#$%^&*()_+{}|:"<>?',
    ],
)
def test_round_trip_tricky(tok, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_random(tok) -> None:
    rng = random.Random(0)
    texts = ["".join(rng.choice(PRINTABLE) for _ in range(rng.randint(1, 80))) for _ in range(200)]
    for text in texts:
        ids = tok.encode(text)
        assert len(ids) == len(text)
        assert tok.decode(ids) == text
    assert tok.batch_decode([tok.encode(t) for t in texts]) == texts


def test_unknown_chars_become_question_marks(tok) -> None:
    ids = tok.encode("a\té")
    assert len(ids) == 3 and tok.decode(ids) == "a??"


def test_special_tokens(tok) -> None:
    text = "<|im_start|>user\n1+2=<|im_end|>\n<|endoftext|>"
    ids = tok.encode(text)
    assert ids[0] == IM_START_ID and EOS_TOKEN_ID in ids and ids[-1] == PAD_TOKEN_ID
    assert len(ids) == 3 + len("user\n1+2=\n")
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\n1+2=\n"


def test_chat_template(tok, tok_dir: Path) -> None:
    assert "chat_template" in json.loads((tok_dir / "tokenizer_config.json").read_text())
    messages = [{"role": "system", "content": "sum"}, {"role": "user", "content": "3+4="}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nsum<|im_end|>\n<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == rendered.removesuffix("<|im_start|>assistant\n")
    assert tok.decode(tok.encode(rendered)) == rendered
    # transformers 5: tokenize=True returns a BatchEncoding unless return_dict=False.
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == tok.encode(rendered)


def test_load_tokenizer_is_what_autotokenizer_loads(tok_dir: Path, tok) -> None:
    """`load_tokenizer` skips `AutoTokenizer` for the generic class; transformers' own
    `AutoTokenizer` is the referee: same class, vocabulary, specials, settings and outputs."""
    from slimrl.data.hf_tokenizer import load_tokenizer

    mine = load_tokenizer(tok_dir)
    assert type(mine) is type(tok)
    assert mine.get_vocab() == tok.get_vocab() and mine.all_special_tokens == tok.all_special_tokens
    assert mine.init_kwargs == tok.init_kwargs and mine.model_max_length == tok.model_max_length
    assert (mine.eos_token_id, mine.pad_token_id, mine.bos_token) == (
        tok.eos_token_id,
        tok.pad_token_id,
        None,
    )
    for text in (PRINTABLE, "12+34=", "<|im_start|>user\nhi<|im_end|>", "é ü"):
        assert mine.encode(text) == tok.encode(text)
        assert mine.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    messages = [{"role": "user", "content": "3+4="}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    for kwargs in ({}, {"tools": tools}):
        assert mine.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs) == (
            tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        )


def test_load_tokenizer_of_the_generic_class_imports_no_torch(tok_dir: Path) -> None:
    """The point of the shortcut: a process that only tokenizes (the rollout manager) does not
    import torch (~6 CPU-s through `AutoTokenizer`)."""
    import subprocess
    import sys

    code = (
        "import sys; from slimrl.data.hf_tokenizer import load_tokenizer; "
        f"t = load_tokenizer({str(tok_dir)!r}); print(type(t).__name__, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["TokenizersBackend", "False"]


def test_load_tokenizer_leaves_model_specific_classes_to_autotokenizer(tok_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from slimrl.data.hf_tokenizer import load_tokenizer

    specific = tmp_path / "qwen2_named"
    specific.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (specific / name).write_bytes((tok_dir / name).read_bytes())
    config = json.loads((specific / "tokenizer_config.json").read_text())
    (specific / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"})
    )
    mine, theirs = load_tokenizer(specific), AutoTokenizer.from_pretrained(specific)
    assert type(mine) is type(theirs) and type(mine).__name__ == "Qwen2Tokenizer"
    assert mine.encode("12+34=") == theirs.encode("12+34=")
