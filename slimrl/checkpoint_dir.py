"""The checkpoint directory, as the driver keeps it (what every rank writes into it is
`trainer/checkpoint.py`'s). Layout under `checkpoint.save_dir`:

    iter_0000004/      a complete checkpoint (torch_dist files + driver_state.json + rng_rank*.pt)
        critic/        PPO only: the value model's own torch_dist checkpoint
    latest             text file naming the newest complete checkpoint
    history.json       the checkpoints this directory's runs published, in completion order

All ranks write into a temporary sibling directory (`new_tmp_dir`); the driver adds its own state
(rollout id, data position, buffer) and only then renames it into place and rewrites `latest`
(`publish`, both atomic). A kill at any point leaves the previous checkpoint as `latest`.

Pruning keeps the `keep_last` most recently *completed* checkpoints named in `history.json`
(never by step number: a run restarted at an earlier step would otherwise delete what it just
wrote), so it never removes the newest one or one no run here published. A pruned checkpoint is
first renamed aside, so a kill mid-delete never leaves a half-deleted directory that looks whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slimrl.errors import ConfigError
from slimrl.utils.fs import atomic_write_text, replace_directory

if TYPE_CHECKING:
    from slimrl.config.schema import SlimConfig

LATEST = "latest"
HISTORY = "history.json"
SUPERSEDED = "superseded.json"
DRIVER_STATE = "driver_state.json"
_ITER = re.compile(r"^iter_(\d{7})$")


def iteration_dir(root: Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    marker = Path(root) / LATEST
    if not marker.is_file():
        return None
    path = Path(root) / marker.read_text().strip()
    return path if (path / DRIVER_STATE).is_file() else None


def checkpoint_root(config: SlimConfig, run_dir: Path) -> Path:
    return Path(config.checkpoint.save_dir) if config.checkpoint.save_dir else Path(run_dir) / "checkpoints"


def complete_checkpoints(root: Path) -> list[str]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if _ITER.match(p.name) and (p / DRIVER_STATE).is_file())


def prepare_start(root: Path, resume: bool, overwrite: bool) -> None:
    """Before anything starts: a run that will not resume may not silently reuse a directory that
    holds an earlier run's checkpoints. With `overwrite` they are kept until this run's first
    checkpoint is complete, and only then removed (`publish`)."""
    existing = complete_checkpoints(root)
    if resume or not existing:
        return
    if not overwrite:
        raise ConfigError(
            f"checkpoint.resume=false: {root} holds checkpoints of an earlier run ({', '.join(existing)}); "
            f"set checkpoint.resume=true to continue it, checkpoint.overwrite=true to replace it, "
            f"or choose another run.name / checkpoint.save_dir"
        )
    atomic_write_text(Path(root) / SUPERSEDED, json.dumps(existing))
    atomic_write_text(Path(root) / HISTORY, json.dumps([]))


def new_tmp_dir(root: Path, step: int) -> Path:
    """A fresh temporary directory for the checkpoint of `step` (leftovers of killed saves go)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".iter_*.tmp"):  # one save at a time per directory: any other is dead
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".iter_{step:07d}.tmp"
    tmp.mkdir()
    return tmp


def publish(root: Path, tmp: Path, step: int, driver_state: dict[str, Any], keep_last: int) -> Path:
    """Driver: add its state, rename into place, point `latest` at it, prune old ones."""
    if keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={keep_last}: must be >= 1 (0 would delete every checkpoint)")
    atomic_write_text(tmp / DRIVER_STATE, json.dumps(driver_state))
    final = iteration_dir(root, step)
    replace_directory(tmp, final, overwrite=True)
    history = [n for n in _read_json(root / HISTORY, []) if n != final.name and _complete(root, n)]
    history.append(final.name)
    atomic_write_text(root / HISTORY, json.dumps(history))
    atomic_write_text(root / LATEST, final.name + "\n")
    doomed = history[:-keep_last] + [n for n in _read_json(root / SUPERSEDED, []) if n not in history]
    for name in doomed:
        _remove(root / name)
    atomic_write_text(root / HISTORY, json.dumps(history[-keep_last:]))
    (root / SUPERSEDED).unlink(missing_ok=True)
    for stale in root.glob(".iter_*.deleting"):  # what a kill mid-prune left
        shutil.rmtree(stale, ignore_errors=True)
    return final


def _complete(root: Path, name: str) -> bool:
    return bool(_ITER.match(name)) and (Path(root) / name / DRIVER_STATE).is_file()


def _remove(path: Path) -> None:
    """Rename aside, then delete: a kill mid-delete leaves `.iter_*.deleting`, never a checkpoint
    that still has its driver state but lost some shards."""
    if not path.exists():
        return
    aside = path.with_name(f".{path.name}.deleting")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def read_driver_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / DRIVER_STATE).read_text())
