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
import sys
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
        if isinstance(node, ast.ImportFrom) and node.module == "slimrl":  # `from slimrl import estimators`
            names.update(f"slimrl.{alias.name}" for alias in node.names if alias.name != "__version__")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
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


def _module_of(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_of(p): p for p in (REPO / "slimrl").rglob("*.py")}


def _resolve(dotted: str) -> str | None:
    """The slimrl module a dotted import name loads (`slimrl.a.b.name` -> `slimrl.a.b`)."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _top_level_imports(module: str) -> set[str]:
    """Names the module imports when it loads (not inside functions; `TYPE_CHECKING` excluded)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                visit(node.orelse)
                visit(node.finalbody)
                for handler in node.handlers:
                    visit(handler.body)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])

    visit(ast.parse(MODULES[module].read_text()).body)
    return names


def _loads(module: str) -> tuple[set[str], set[str]]:
    """Every slimrl module and every third-party package that loading `module` loads."""
    own: set[str] = set()
    third_party: set[str] = set()
    stack = [module]
    while stack:
        current = stack.pop()
        if current in own:
            continue
        own.add(current)
        parts = current.split(".")
        stack.extend(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in MODULES)
        for name in _top_level_imports(current):
            root = name.split(".")[0]
            if root == "slimrl":
                target = _resolve(name)
                if target is not None:
                    stack.append(target)
            elif root not in sys.stdlib_module_names:
                third_party.add(root)
    return own, third_party


def test_imports_inside_functions_only_defer_a_package() -> None:
    """A slimrl import inside a function is there for one reason, checked here: what it loads brings
    a third-party package the importing module does not load (start-up time: torch, Megatron, Ray,
    SGLang, transformers ... stay out of processes and commands that never use them). Any other
    belongs at the top of the module, and one that would close an import loop (the module it loads
    loads the importer) is a loop to remove, not to hide."""
    plain = []
    for module, path in MODULES.items():
        own_third_party = _loads(module)[1]
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("slimrl."):
                    targets = {_resolve(f"{node.module}.{alias.name}") for alias in node.names}
                elif isinstance(node, ast.Import):
                    targets = {_resolve(a.name) for a in node.names if a.name.startswith("slimrl.")}
                else:
                    continue
                for target in targets - {None, module}:
                    loaded, third_party = _loads(target)  # type: ignore[arg-type]
                    where = f"{path.relative_to(REPO)}:{node.lineno} imports {target}"
                    if module in loaded:
                        plain.append(f"{where}, which loads {module}: an import loop")
                    elif not third_party - own_third_party:
                        plain.append(f"{where}, which loads no package {module} does not")
    assert not plain, "\n".join(sorted(set(plain)))


PICTURE_BEGIN, PICTURE_END = (
    "<!-- floors: generated by python -m tests.test_package_deps -->",
    "<!-- /floors -->",
)


def house_picture() -> str:
    """The floors from the top, each with its rooms and the floors it imports from (from the code)."""
    below: dict[int, set[int]] = {}
    for a, b in edges():
        below.setdefault(floor_of(a), set()).add(floor_of(b))
    lines = ["```", "floor  rooms (slimrl/...)                         imports from floors"]
    for index in reversed(range(len(FLOORS))):
        rooms = ", ".join(sorted(FLOORS[index]))
        uses = ", ".join(str(i) for i in sorted(below.get(index, set()), reverse=True)) or "-"
        lines.append(f"{index:>5}  {rooms:<45} {uses}")
    return "\n".join([*lines, "```"])


def test_the_architecture_doc_shows_the_floors_of_the_code() -> None:
    """docs/architecture.md's floor plan is this module's, regenerated: `python
    -m tests.test_package_deps` rewrites it."""
    text = (REPO / "docs" / "architecture.md").read_text()
    shown = text.split(PICTURE_BEGIN, 1)[1].split(PICTURE_END, 1)[0].strip()
    assert shown == house_picture(), "run: python -m tests.test_package_deps"


if __name__ == "__main__":
    doc = REPO / "docs" / "architecture.md"
    head, rest = doc.read_text().split(PICTURE_BEGIN, 1)
    doc.write_text(f"{head}{PICTURE_BEGIN}\n{house_picture()}\n{PICTURE_END}{rest.split(PICTURE_END, 1)[1]}")
