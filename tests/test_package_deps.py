"""One-way package dependencies: utilities and the CPU compat seams below everything; the weight-sync
wire and its transports below the trainer, the rollout engines and the driver; neither the trainer
nor the rollout side reaches up into the driver (`orchestration`) or the CLI. A function-level
import counts the same as a top-level one (no hidden cycles)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

_BELOW_DRIVER = {
    "slimrl.errors", "slimrl.sample", "slimrl.sampled", "slimrl.utils", "slimrl.compat", "slimrl.config",
    "slimrl.data", "slimrl.megatron_bridge", "slimrl.weight_sync", "slimrl.devices", "slimrl.parallel_layout",
}  # fmt: skip
ALLOWED = {
    "slimrl.utils": {"slimrl.errors", "slimrl.utils"},
    "slimrl.compat": {"slimrl.errors", "slimrl.compat"},
    # the device ledger and the GPU's rules: read by the config gate, the trainer and the driver
    "slimrl.devices": {"slimrl.errors", "slimrl.config", "slimrl.devices"},
    "slimrl.weight_sync": {"slimrl.errors", "slimrl.utils", "slimrl.megatron_bridge", "slimrl.devices"}
    | {"slimrl.weight_sync"},
    "slimrl.trainer": _BELOW_DRIVER | {"slimrl.trainer"},
    "slimrl.rollout": _BELOW_DRIVER | {"slimrl.trainer", "slimrl.rollout"},
}


def slimrl_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith("slimrl.")}  # the bare package only holds __version__


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
