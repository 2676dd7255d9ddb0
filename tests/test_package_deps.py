"""One-way package dependencies for the packages this layer added: the weight-sync wire and its
transports sit below the trainer, the rollout engines and the driver; the CPU compat seams below
everything. A function-level import counts the same as a top-level one (no hidden cycles)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

ALLOWED = {
    "slimrl.weight_sync": {"slimrl.errors", "slimrl.megatron_bridge", "slimrl.weight_sync"},
    "slimrl.compat": {"slimrl.errors", "slimrl.compat"},
}


def slimrl_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n == "slimrl" or n.startswith("slimrl.")}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_lies_below_it(package: str) -> None:
    root = REPO / Path(*package.split("."))
    offenders = {
        f"{path.relative_to(REPO)}: {name}"
        for path in root.rglob("*.py")
        for name in slimrl_imports(path)
        if not any(name == allowed or name.startswith(allowed + ".") for allowed in ALLOWED[package])
    }
    assert not offenders, sorted(offenders)
