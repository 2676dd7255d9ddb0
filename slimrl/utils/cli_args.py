"""Flags of every entry point, checked as the config keys are: a bad value is one line naming the
flag, the value and what would be valid, exit 2, before anything starts.

`OneLineParser` prints argparse's errors without the usage block; the `type=` checkers below are
the only ones a flag may use (`tests/test_cli_flags.py` walks every parser and fails on a flag that
takes a value without one of them, choices, or a reason in its `FREE_FORM` list).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(2)


def _int(text: str, low: int, high: int | None, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; expected {what}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"{value} is out of range; expected {what}")
    return value


def port(text: str) -> int:
    return _int(text, 1, 65535, "a TCP port 1-65535")


def positive_int(text: str) -> int:
    return _int(text, 1, None, "a whole number >= 1")


def non_negative_int(text: str) -> int:
    return _int(text, 0, 2**63 - 1, "a whole number >= 0")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; expected a number > 0") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is out of range; expected a finite number > 0")
    return value


def plain_name(text: str) -> str:
    """A name that becomes one directory or file name: never a path of its own."""
    if not _PLAIN_NAME.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a plain name (letters, digits, `_`, `.`, `-`, not starting with `.` or `-`)"
        )
    return text


def is_plain_name(text: str) -> bool:
    return bool(_PLAIN_NAME.match(text))


CHECKED_TYPES = (port, positive_int, non_negative_int, positive_float, plain_name)
"""Every value-taking flag uses one of these (or `choices`), unless listed as free-form."""
