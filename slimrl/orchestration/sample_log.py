"""`rollout_samples.jsonl` in the run directory: every sample of every rollout, one JSON object per
line (its `Sample` fields plus `rollout_id` and `split`; routed experts as dtype and shape only),
written by `slimrl rollout` and by `slimrl train` when `rollout.save_samples` is on. The groups a
rollout set aside unfinished (a failed or aborted sample: a request that failed, an agent that
raised or timed out) follow with `split` "train/unfinished", each failed sample's reason in
`metadata["failure"]`: not trained on, but never silently gone."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

SAMPLES_FILE = "rollout_samples.jsonl"
Group = list[Any]


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
        json.dumps({"rollout_id": rollout_id, "split": split, **_fields(sample)}) + "\n"
        for group in groups
        for sample in group
    ]
    with Path(path).open("a") as handle:
        handle.write("".join(lines))


def write_rollout(
    path: Path, rollout_id: int, groups: list[list[Any]], split: str, unfinished: list[list[Any]]
) -> None:
    """A rollout's groups, then the ones it set aside unfinished (`<split>/unfinished`)."""
    write_samples(path, rollout_id, groups, split)
    if unfinished:
        write_samples(path, rollout_id, unfinished, f"{split}/unfinished")


def _fields(sample: Any) -> dict[str, Any]:
    """`Sample.to_dict()` without its deep copy (3x faster; json.dumps copies anyway). Routed
    experts (routing replay) are logged as their dtype and shape only: the ids themselves would be
    ~33 MB of base64 per 32k-token sample on a 94-layer top-8 model, and the trainer has them."""
    fields = dict(vars(sample))
    fields["status"] = sample.status.value
    routing = fields.get("rollout_routed_experts")
    if routing is not None:
        routing = np.asarray(routing)
        fields["rollout_routed_experts"] = {"dtype": routing.dtype.name, "shape": list(routing.shape)}
    return fields


class SampleLog:
    """The samples file of `slimrl train`: each rollout is appended on a background thread, so the
    loop never waits for the disk (~10 ms per demo rollout); `close` waits for the last one."""

    def __init__(self, run_dir: Path, start_rollout: int = 0) -> None:
        self.path = start_samples(run_dir, start_rollout)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sample-log")
        self._last: Future[None] | None = None

    def append(
        self, rollout_id: int, groups: list[list[Any]], split: str = "train", unfinished: Sequence[Group] = ()
    ) -> None:
        """Queue a rollout (and the groups it set aside unfinished); the samples must not change
        afterwards (the trainer only reads them)."""
        self._wait()
        self._last = self._pool.submit(write_rollout, self.path, rollout_id, groups, split, list(unfinished))

    def _wait(self) -> None:
        if self._last is not None:
            self._last.result()  # a failed write raises here

    def close(self) -> None:
        try:
            self._wait()
        finally:
            self._pool.shutdown(wait=True)
