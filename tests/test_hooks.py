"""load_function: dotted paths resolve, are cached, and every failure is one line naming the key."""

from __future__ import annotations

import sys
from pathlib import Path

import hook_fixtures
import pytest

from slimrl.errors import ConfigError
from slimrl.utils.hooks import load_function

KEY = "rollout.custom_rm_path"


def _error(path: str, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_function(path, key=KEY, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{KEY}={path}: ")
    return message


def test_dotted_and_colon_paths() -> None:
    assert load_function("hook_fixtures.sync_two", key=KEY) is hook_fixtures.sync_two
    assert load_function("hook_fixtures:sync_two", key=KEY) is hook_fixtures.sync_two
    assert load_function("hook_fixtures:Scorer.score", key=KEY) is hook_fixtures.Scorer.score
    assert load_function("os.path.join", key=KEY, required_params=("a", "b")) is __import__("os").path.join


def test_loaded_functions_are_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_function("hook_fixtures.with_default", key=KEY, required_params=("config", "sample"))
    monkeypatch.setattr(hook_fixtures, "with_default", hook_fixtures.sync_two)
    again = load_function("hook_fixtures.with_default", key=KEY, required_params=("config", "sample"))
    assert again is first is not hook_fixtures.with_default


def test_missing_module_names_module_and_import_error() -> None:
    message = _error("no_such_pkg_xyz.rewards.score")
    assert "cannot import module `no_such_pkg_xyz.rewards`" in message
    assert "No module named 'no_such_pkg_xyz'" in message


def test_module_whose_dependency_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hooks_missing_dep.py").write_text(
        "import missing_dep_abc\n\ndef rm(config, sample):\n    pass\n"
    )
    (tmp_path / "hooks_broken.py").write_text("def rm(config, sample)\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        message = _error("hooks_missing_dep.rm")
        assert "cannot import module `hooks_missing_dep`: No module named 'missing_dep_abc'" in message
        message = _error("hooks_broken.rm")
        assert "importing module `hooks_broken` failed: SyntaxError" in message
    finally:
        for name in ("hooks_missing_dep", "hooks_broken"):
            sys.modules.pop(name, None)


def test_missing_attribute_suggests_public_callables() -> None:
    message = _error("hook_fixtures.length_mr")
    assert "module `hook_fixtures` has no attribute `length_mr`" in message
    suggestions = message.split("(public callables: ")[1].rstrip(")").split(", ")
    assert len(suggestions) == 5
    assert suggestions[0] == "length_rm"
    assert "NOT_CALLABLE" not in suggestions and "Any" not in suggestions  # imported names excluded


def test_not_callable() -> None:
    assert "`NOT_CALLABLE` is a int, not a callable" in _error("hook_fixtures.NOT_CALLABLE")


def test_async_ness() -> None:
    assert "must be an `async def` function" in _error("hook_fixtures.sync_rm", must_be_async=True)
    assert "must be a plain `def` function" in _error("hook_fixtures.length_rm", must_be_async=False)
    assert load_function("hook_fixtures.length_rm", key=KEY, must_be_async=True) is hook_fixtures.length_rm
    # Callable objects with `async def __call__` count as async.
    loaded = load_function("hook_fixtures.async_callable", key=KEY, must_be_async=True)
    assert loaded is hook_fixtures.async_callable


def test_signature_must_accept_the_positional_arguments() -> None:
    params = ("config", "sample")
    message = _error("hook_fixtures.one_param", required_params=params)
    assert "signature (config: 'Any') -> 'float' cannot be called as f(config, sample)" in message
    assert "too many positional arguments" in message
    message = _error("hook_fixtures.needs_keyword", required_params=params)
    assert "missing a required argument: 'tokenizer'" in message
    for ok in ("var_args", "with_default", "sync_two"):
        load_function(f"hook_fixtures.{ok}", key=KEY, required_params=params)


@pytest.mark.parametrize("path", ["nodots", "module.", ":func", "pkg:"])
def test_malformed_paths(path: str) -> None:
    assert "expected a dotted path `package.module.func`" in _error(path)
