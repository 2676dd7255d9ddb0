"""Imports only run down the floors, for every package and top-level module of `slimrl`: errors at
the bottom; utilities, the CPU compat seams and the shared contracts (model architecture, samples)
above it; then the config schema, the parallel layout, the device ledger, the bridge, the data and
the weight-sync wire, one training rank, the rollout side, the config gate (`preflight`: loading,
checks, finalisation), the driver and the CLI. A function-level
import counts the same as a top-level one (no hidden cycles).

The few edges that still run up are listed with the move of issue 23 that removes them; a listed
edge that no longer exists fails too, so the list only shrinks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

FLOORS = [
    {"errors"},
    {"utils", "compat", "model_arch", "sample", "sampled", "estimators", "policy_losses"},
    {"config"},
    {"checkpoint_dir"},
    {"parallel_layout"},
    {"devices"},
    {"megatron_bridge"},
    {"data", "weight_sync", "planning"},
    {"trainer"},
    {"conversion"},
    {"rollout"},
    {"preflight"},
    {"orchestration"},
    {"cli"},
]

KNOWN_BACK_EDGES: set[tuple[str, str]] = set()
"""Empty: every import runs down. (Kept, with its test, so an exception is added in the open.)"""


def floor_of(room: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if room in rooms)


def room_of(dotted: str) -> str:
    return dotted.split(".")[1]


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith("slimrl.")}  # the bare package only holds __version__


def edges() -> dict[tuple[str, str], list[str]]:
    """(room, room it imports) -> the files that do it, rooms apart."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted((REPO / "slimrl").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if len(parts) < 2 or parts[1] == "__init__":
            continue
        room = parts[1]
        for name in imports(path):
            if room_of(name) != room:
                found.setdefault((room, room_of(name)), []).append(str(path.relative_to(REPO)))
    return found


def test_every_room_has_a_floor() -> None:
    rooms = {p.stem if p.is_file() else p.name for p in (REPO / "slimrl").iterdir()}
    rooms = {r for r in rooms if not r.startswith("__") and r != "py"}
    placed = set().union(*FLOORS)
    assert rooms - placed == set(), "place these in FLOORS"
    assert placed - rooms == set(), "gone from slimrl/"


def test_imports_only_run_down() -> None:
    up = {
        f"{a} -> {b}: {files[0]}"
        for (a, b), files in edges().items()
        if floor_of(b) >= floor_of(a) and (a, b) not in KNOWN_BACK_EDGES
    }
    assert not up, sorted(up)


def test_every_known_back_edge_is_still_there_and_runs_up() -> None:
    assert KNOWN_BACK_EDGES - edges().keys() == set(), "remove these from KNOWN_BACK_EDGES"
    assert all(floor_of(b) >= floor_of(a) for a, b in KNOWN_BACK_EDGES)


@pytest.mark.parametrize("room", sorted(FLOORS[1]))
def test_the_ground_floor_imports_only_errors(room: str) -> None:
    assert {b for (a, b) in edges() if a == room} <= {"errors"}
