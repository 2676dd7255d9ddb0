"""Toy prompt sets: deterministic, well-formed, labels right, binary exact-match reward; CLI paths."""

import json
import os
import re
from pathlib import Path

import pytest

from slimrl.cli import main
from slimrl.data.toy_tasks import TASKS, extract_answer, generate_samples, get_task, make_data
from slimrl.errors import SlimError

os.environ["HF_HUB_OFFLINE"] = "1"  # none of the imports above loads huggingface_hub


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _expected_label(task: str, prompt: str) -> str:
    """Recompute the answer from the prompt text alone, checking the operand ranges on the way."""
    if task in ("mod_sum", "add", "tool_sum"):
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", prompt).groups())
        low, high = {"mod_sum": (0, 9), "add": (0, 99), "tool_sum": (10, 99)}[task]
        assert low <= a <= high and low <= b <= high
        return str(a + b) if task == "add" else str((a + b) % 10)
    if task == "reverse":
        (digits,) = re.fullmatch(r"rev (\d{3})=", prompt).groups()
        return digits[::-1]
    assert task == "chain"
    tokens = re.fullmatch(r"(\d)([+-]\d)([+-]\d)=", prompt).groups()
    value = int(tokens[0])
    for step in tokens[1:]:
        value += int(step)
        assert 0 <= value <= 9, f"partial result out of range in {prompt}"
    return str(value)


def test_tool_sum_sft_is_whole_conversations_with_the_agents_tool(tmp_path: Path) -> None:
    """A calculator call (no arguments) or a one-digit guess after the user's sum, half each."""
    from examples import calculator_agent

    records = _read_jsonl(make_data("tool_sum_sft", tmp_path / "c.jsonl", num_samples=400, seed=3))
    call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    calls = 0
    for record in records:
        assert set(record) == {"prompt", "label", "metadata", "tools"}
        assert record["tools"] == calculator_agent.TOOLS  # the system turn the agent's calls render
        user, reply = record["prompt"]
        assert user["role"] == "user" and record["label"] == _expected_label("tool_sum", user["content"])
        if reply.get("tool_calls"):
            calls += 1
            assert reply == {"role": "assistant", "content": "", "tool_calls": [call]}
        else:
            assert reply["role"] == "assistant" and re.fullmatch(r"\d", reply["content"])
    assert 160 < calls < 240  # half of 400, within 4 standard deviations


@pytest.mark.parametrize("task", sorted(set(TASKS) - {"tool_sum_sft"}))
def test_schema_and_labels(task: str, tmp_path: Path) -> None:
    out = make_data(task, tmp_path / f"{task}.jsonl", num_samples=300, seed=3)
    records = _read_jsonl(out)
    assert len(records) == 300
    for record in records:
        assert set(record) == {"prompt", "label", "metadata"}
        assert isinstance(record["prompt"], str) and isinstance(record["label"], str)
        assert record["metadata"]["task"] == task
        assert record["label"] == _expected_label(task, record["prompt"])
        assert get_task(task).score(record["label"], record["label"]) == 1.0
    assert len({r["prompt"] for r in records}) > 20, "prompts should vary"


def test_single_token_answers_cover_all_digits() -> None:
    for task in ("mod_sum", "chain", "tool_sum"):
        labels = {r["label"] for r in generate_samples(task, 500, seed=0)}
        assert labels == {str(d) for d in range(10)}, task


def test_determinism_by_seed(tmp_path: Path) -> None:
    for task in TASKS:
        a = make_data(task, tmp_path / "a.jsonl", num_samples=50, seed=7).read_bytes()
        b = make_data(task, tmp_path / "b.jsonl", num_samples=50, seed=7).read_bytes()
        c = make_data(task, tmp_path / "c.jsonl", num_samples=50, seed=8).read_bytes()
        assert a == b and a != c, task
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["a.jsonl", "b.jsonl", "c.jsonl"]


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("7", "7", 1.0),
        (" 7 ", "7", 1.0),
        ("7<|im_end|>", "7", 1.0),
        ("7<|im_end|>\n<|endoftext|>", "7", 1.0),
        ("7\n8+1=9", "7", 1.0),
        ("7<|endoftext|>junk", "7", 1.0),
        ("8", "7", 0.0),
        ("77", "7", 0.0),
        ("", "7", 0.0),
        ("<|im_end|>7", "7", 0.0),
        ("the answer is 7", "7", 0.0),
        ("106<|im_end|>", "106", 1.0),
        ("10 6", "106", 0.0),
    ],
)
def test_score(response: str, label: str, reward: float) -> None:
    for task in TASKS.values():
        assert task.score(response, label) == reward


def test_extract_answer() -> None:
    assert extract_answer("321\nrev") == "321"
    assert extract_answer("  12 ") == "12"


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(SlimError, match="mod_sum, add, reverse, chain, tool_sum, tool_sum_sft"):
        get_task("nope")
    with pytest.raises(SlimError, match="--num 0"):
        make_data("add", tmp_path / "x.jsonl", num_samples=0)
    with pytest.raises(SlimError, match="directory"):
        make_data("add", tmp_path, num_samples=5)
    assert not list(tmp_path.iterdir())


def test_cli_make_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "data" / "mod.jsonl"
    assert main(["make-data", "--task", "mod_sum", "--out", str(out), "--num", "20", "--seed", "1"]) == 0
    assert _read_jsonl(out) == generate_samples("mod_sum", 20, seed=1)
    assert "20 mod_sum samples" in capsys.readouterr().out


def test_cli_unknown_task(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:  # argparse's choices: one line, exit 2
        main(["make-data", "--task", "sudoku", "--out", str(tmp_path / "x.jsonl")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert err.count("\n") == 1 and "sudoku" in err and "mod_sum" in err
    assert not list(tmp_path.iterdir())


def test_cli_make_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from slimrl.megatron_bridge.archs import read_model_arch

    out = tmp_path / "tiny"
    argv = ["make-tiny", "--arch", "qwen3_moe", "--out", str(out), "--set", "num_experts=3"]
    assert main(argv) == 0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert read_model_arch(out).num_experts == 3
    capsys.readouterr()
    assert main(argv) != 0  # exists, no --force
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--force" in err
    assert main([*argv, "--force", "--seed", "1"]) == 0
    assert main(["make-tiny", "--arch", "qwen3", "--out", str(tmp_path / "t2"), "--set", "bogus=1"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bogus" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]
