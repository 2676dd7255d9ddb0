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
