"""`rollout_samples.jsonl` in the run directory: every sample of every rollout, one JSON object per
line (its `Sample` fields plus `rollout_id` and `split`), written by `slimrl rollout` and by
`slimrl train` when `rollout.save_samples` is on."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SAMPLES_FILE = "rollout_samples.jsonl"


def start_samples(run_dir: Path, start_rollout: int = 0) -> Path:
    """The run's samples file, holding only the rollouts before `start_rollout`: a resumed run keeps
    what its checkpoint covers and drops the rollouts it will redo; a fresh run starts it empty."""
    path = Path(run_dir) / SAMPLES_FILE
    if start_rollout == 0 or not path.exists():
        path.write_text("")
        return path
    partial = path.with_name(path.name + ".partial")
    with path.open() as source, partial.open("w") as target:
        for line in source:
            try:
                keep = json.loads(line)["rollout_id"] < start_rollout
            except (ValueError, KeyError, TypeError):  # a line cut by a kill: the run redoes it
                keep = False
            if keep:
                target.write(line)
    os.replace(partial, path)
    return path


def write_samples(path: Path, rollout_id: int, groups: list[list[Any]], split: str) -> None:
    """Append one JSON object per sample: its `Sample` fields plus `rollout_id` and `split`."""
    lines = [
        json.dumps({"rollout_id": rollout_id, "split": split, **sample.to_dict()}) + "\n"
        for group in groups
        for sample in group
    ]
    with Path(path).open("a") as handle:
        handle.write("".join(lines))
