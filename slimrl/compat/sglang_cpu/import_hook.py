"""Patch a module of SGLang right after it loads, whichever of SGLang and our stand-in imports first.

The CPU patches (`host_memory.py`, `memory_saver.py`) are installed by the `sgl_kernel` stand-in,
the first of our modules to run in every CPU server process; the SGLang module they patch may be
loaded before that import or long after it. `patch_when_loaded` patches it now if it is loaded,
else wraps its loader so the patch runs as soon as its code has executed.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType
from typing import Any


class _PatchAfterLoad(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of `name` so `then` runs once it has loaded."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one module, once; and the real finders must answer below
        spec = PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        load, then = spec.loader.exec_module, self.then

        def exec_then_patch(module: ModuleType) -> None:
            load(module)
            then(module)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


def patch_when_loaded(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Run `patch(module)` on module `name` now if loaded, else right after it loads (once)."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        patch(loaded)
    elif not any(isinstance(f, _PatchAfterLoad) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterLoad(name, patch))
