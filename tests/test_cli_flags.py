"""Every flag of every entry point (`slimrl train|rollout|plan|plot|make-tiny|make-data|serve|convert`,
`tools/convert/*`) is checked as the config keys are: a bad value is one line on stderr naming the
flag, exit 2, nothing started. The parsers are walked, so a new flag that takes a value without a
checker, choices or a stated reason fails `test_every_flag_that_takes_a_value_is_checked`."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from slimrl.cli import build_parser
from slimrl.cli import main as slimrl_main
from slimrl.conversion.cli import _workers
from slimrl.utils.cli_args import (
    CHECKED_TYPES,
    non_negative_int,
    plain_name,
    port,
    positive_float,
    positive_int,
)
from tests.conftest import REPO

FREE_FORM = {
    "config": "a YAML file: the loader refuses a missing or malformed one in one line (exit 2)",
    "overrides": "config keys: the config gate checks every key and value (tests/test_config.py)",
    "run_dir": "a run directory: `plot` refuses one without metrics.jsonl in one line",
    "key": "a metric key: `plot` refuses one the run never wrote, listing those it did",
    "out": "an output path: make-tiny refuses an existing one without --force, convert one that "
    "overlaps an input; make-data and plot create it",
    "set": "config.json key=value of make-tiny: a malformed item or value is one line",
    "model": "an HF checkpoint directory: `serve` refuses one without config.json",
    "host": "an address to bind: the server reports a failed bind in one line",
    "api_key": "a secret of the user's choosing",
    "admin_api_key": "a secret of the user's choosing",
    "hf_dir": "an HF checkpoint directory: convert refuses one without config.json in one line",
    "ckpt": "a torch_dist checkpoint: convert refuses a missing or partial one in one line",
    "hf_config_dir": "an HF directory with config.json: convert refuses one without it",
    "compare": "a YAML file (plan --compare): the loader refuses a missing or malformed one in one line",
}
BAD = {
    port: "0",
    positive_int: "0",
    non_negative_int: "-1",
    positive_float: "0",
    plain_name: "../up",
    _workers: "0",
}
REQUIRED = {
    ("train",): ["cfg.yaml"], ("rollout",): ["cfg.yaml"], ("plan",): ["cfg.yaml"], ("plot",): ["run"],
    ("make-tiny",): ["--arch", "qwen3", "--out", "o"], ("make-data",): ["--task", "add", "--out", "o"],
    ("serve",): ["--model", "m", "--port", "8000"],
    ("convert", "hf-to-mcore"): ["--hf-dir", "h", "--out", "o"],
    ("convert", "mcore-to-hf"): ["--ckpt", "c", "--out", "o", "--hf-config-dir", "h"],
}  # fmt: skip
"""The smallest command line of each entry point (values never read: the bad flag stops parsing)."""


def flags(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if name == "convert":  # `slimrl convert` hands its command line to the bridge's parser
                    from slimrl.conversion.cli import build_parser as convert_parser

                    sub = convert_parser()
                yield from flags(sub, (*path, name))
        elif action.nargs != 0 and not isinstance(action, argparse._HelpAction):
            yield path, action


ALL = sorted(flags(build_parser()), key=lambda item: (item[0], item[1].dest))


def test_every_flag_that_takes_a_value_is_checked() -> None:
    unchecked = [
        f"{' '.join(path)} {action.option_strings or action.dest}"
        for path, action in ALL
        if action.type not in (*CHECKED_TYPES, _workers)
        and action.choices is None
        and action.dest not in FREE_FORM
    ]
    assert not unchecked, f"flags without a check (use slimrl/utils/cli_args.py or choices): {unchecked}"
    assert {path for path, _ in ALL} == set(REQUIRED)  # every entry point is walked


def bad_values() -> Iterator[tuple[list[str], str]]:
    for path, action in ALL:
        if not action.option_strings:
            continue
        flag = action.option_strings[0]
        if action.type in BAD:
            yield [*path, *REQUIRED[path], flag, BAD[action.type]], flag
        elif action.choices is not None:
            yield [*path, *REQUIRED[path], flag, "no-such-choice"], flag


@pytest.mark.parametrize(
    ("argv", "flag"), list(bad_values()), ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_a_bad_flag_value_is_one_line_and_exit_2(
    argv: list[str], flag: str, capsys, tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        slimrl_main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"argument {flag}" in err, err
    assert list(tmp_path.iterdir()) == []  # nothing created


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["serve", "--model", "no-such-dir", "--port", "8000"], "serve --model no-such-dir"),
        (["make-tiny", "--arch", "qwen3", "--out", "o", "--set", "=3"], "make-tiny --set =3"),
        (["plot", "no-such-run"], "no-such-run/metrics.jsonl"),
        (["train", "no-such.yaml"], "no-such.yaml"),
        (["convert", "hf-to-mcore", "--hf-dir", "no-such-dir", "--out", "o"], "no-such-dir"),
    ],
)
def test_free_form_values_are_checked_by_their_command(
    argv: list[str], names: str, capsys, tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    rank_env = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    for name in rank_env:
        monkeypatch.delenv(name, raising=False)
    assert slimrl_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and names in err, err
    assert not (tmp_path / "o").exists()
    # A plain conversion is a world of one only while it runs: left behind, WORLD_SIZE=1 made every
    # later conversion started from this process join a "launched" world of one (CI, session 18).
    assert [name for name in rank_env if name in os.environ] == []


def test_the_conversion_tools_use_the_same_checked_parser() -> None:
    for tool in ("hf_to_megatron.py", "megatron_to_hf.py"):
        text = (REPO / "tools" / "convert" / tool).read_text()
        assert "from slimrl.conversion.cli import main" in text, tool
    assert Path(REPO / "tools" / "convert").is_dir()


def test_conversion_errors_name_the_flags_the_command_has() -> None:
    from slimrl.conversion.cli import flag_names
    from slimrl.megatron_bridge.layout_args import LayoutArgs

    said = "parallel.tp=3: must divide the model's 4 attention heads (valid: 1, 2, 4)"
    assert flag_names(said) == "--tp 3: must divide the model's 4 attention heads (valid: 1, 2, 4)"
    assert LayoutArgs(pp=2).parallel_config(5).pp_layout == [3, 2]  # uneven stages: split, not refused
    with pytest.raises(Exception, match=r"^--pp 6: pipeline stages for only 5 layers \(valid: --pp 1 to 5\)"):
        LayoutArgs(pp=6).parallel_config(5)
