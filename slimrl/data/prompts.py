"""Prompt data sets: JSONL or Parquet rows with configurable keys, in a seeded epoch order."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimrl.errors import SlimError


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    prompt: str | list[dict[str, Any]]
    label: Any
    metadata: dict[str, Any]


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise SlimError(f"{path}: prompt data file not found")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with path.open() as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SlimError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
    return rows


def load_prompts(
    path: str | Path, input_key: str = "prompt", label_key: str = "label", metadata_key: str = "metadata"
) -> list[PromptRecord]:
    records = []
    for index, row in enumerate(read_rows(path)):
        if input_key not in row:
            keys = ", ".join(sorted(row)) or "none"
            raise SlimError(f"{path}: row {index} has no `{input_key}` (data.input_key); its keys: {keys}")
        records.append(
            PromptRecord(
                prompt=row[input_key], label=row.get(label_key), metadata=dict(row.get(metadata_key) or {})
            )
        )
    if not records:
        raise SlimError(f"{path}: no rows")
    return records


class EpochSampler:
    """Yields record indices forever, reshuffling every epoch; its position can be saved."""

    def __init__(self, size: int, seed: int, shuffle: bool = True) -> None:
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.offset = 0, 0

    def _order(self) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            order = self._order()
            chunk = order[self.offset : self.offset + n - len(out)]
            out.extend(chunk)
            self.offset += len(chunk)
            if self.offset >= self.size:
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = state["epoch"], state["offset"]

    def __iter__(self) -> Iterator[int]:
        while True:
            yield from self.take(1)
