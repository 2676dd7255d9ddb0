"""The installed SGLang is the pinned referee (serving on CPU is covered by the contract suite,
`tests/test_engine_contract.py`)."""

from __future__ import annotations

from slimrl.compat.sglang_cpu import SGLANG_RELEASE, check_sglang_version


def test_installed_sglang_is_the_pinned_referee() -> None:
    assert check_sglang_version() == SGLANG_RELEASE
