"""Load user hooks named by dotted paths in the config (`rollout.custom_rm_path` and friends).

A hook is checked when it is loaded, not when it is first called mid-rollout: a typo in the path,
a sync function where an async one is needed, or a signature that cannot take the arguments the
caller passes all fail at start-up as one `ConfigError` line naming the config key.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from slimrl.errors import ConfigError

MAX_SUGGESTIONS = 5


def load_function(
    path: str,
    *,
    key: str,
    required_params: Sequence[str] = (),
    must_be_async: bool | None = None,
) -> Callable[..., Any]:
    """The callable at `path` (`package.module.func` or `package.module:func`), checked and cached.

    `required_params` names the positional arguments the caller will pass (the names only appear
    in messages; empty skips the signature check); `must_be_async` None accepts both kinds.
    """
    return _load(path, key, tuple(required_params), must_be_async)


@functools.cache
def _load(
    path: str, key: str, required_params: tuple[str, ...], must_be_async: bool | None
) -> Callable[..., Any]:
    where = f"{key}={path}"
    module_name, attr_path = _split(path, where)
    module = _import(module_name, where)
    target = _resolve(module, attr_path, where)
    if not callable(target):
        raise ConfigError(f"{where}: `{attr_path}` is a {type(target).__name__}, not a callable")
    _check_async(target, must_be_async, where)
    if required_params:
        _check_signature(target, required_params, where)
    return target


def _split(path: str, where: str) -> tuple[str, str]:
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise ConfigError(f"{where}: expected a dotted path `package.module.func` (or `package.module:func`)")
    return module_name, attr_path


def import_from_working_directory() -> None:
    """Hooks named by dotted path (`examples.custom_reward.reward`) resolve from the working
    directory, as under `python -m`; the `slimrl` console script alone would not look there."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def _import(module_name: str, where: str) -> ModuleType:
    import_from_working_directory()
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{where}: cannot import module `{module_name}`: {_first_line(exc)}") from exc
    except Exception as exc:  # the module's own code failed while importing (SyntaxError, ...)
        raise ConfigError(
            f"{where}: importing module `{module_name}` failed: {type(exc).__name__}: {_first_line(exc)}"
        ) from exc


def _resolve(module: ModuleType, attr_path: str, where: str) -> Any:
    """Walk `Class.method`-style attribute paths; suggest module-level callables on a miss."""
    target: Any = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            hint = _suggestions(module, part) if target is module else ""
            raise ConfigError(f"{where}: module `{module.__name__}` has no attribute `{attr_path}`{hint}")
        target = getattr(target, part)
    return target


def _suggestions(module: ModuleType, wanted: str) -> str:
    """Up to MAX_SUGGESTIONS public callables defined in the module, closest names first."""
    names = sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and callable(value)
        and getattr(value, "__module__", None) == module.__name__
    )
    close = difflib.get_close_matches(wanted, names, n=MAX_SUGGESTIONS, cutoff=0.5)
    ranked = close + [name for name in names if name not in close]
    if not ranked:
        return " (it defines no public functions)"
    return f" (public callables: {', '.join(ranked[:MAX_SUGGESTIONS])})"


def _is_async(target: Callable[..., Any]) -> bool:
    # Python 3.11's iscoroutinefunction misses callable objects with an `async def __call__`.
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(type(target).__call__)


def _check_async(target: Callable[..., Any], must_be_async: bool | None, where: str) -> None:
    if must_be_async is None or _is_async(target) == must_be_async:
        return
    if must_be_async:
        raise ConfigError(f"{where}: must be an `async def` function (the rollout awaits it)")
    raise ConfigError(
        f"{where}: must be a plain `def` function, not `async def` (it is called synchronously)"
    )


def _check_signature(target: Callable[..., Any], required_params: tuple[str, ...], where: str) -> None:
    """Bind placeholder positional arguments: catches too few slots and extra required params."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # builtins without introspectable signatures: trust them
        return
    try:
        signature.bind(*(object() for _ in required_params))
    except TypeError as exc:
        call = f"({', '.join(required_params)})"
        raise ConfigError(f"{where}: signature {signature} cannot be called as f{call}: {exc}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
