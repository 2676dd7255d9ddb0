"""Per-step metrics: one JSON line per step in `metrics.jsonl`, the same scalars in TensorBoard."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from slimrl.utils.fs import atomic_write_text


class MetricsWriter:
    """`start_step` is the last step already done (0 for a fresh run): rows after it, left by an
    earlier attempt of the same run, are dropped so the file reads as one uninterrupted run."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, start_step: int = 0) -> None:
        self.path = run_dir / "metrics.jsonl"
        kept = [r for r in read_metrics(self.path) if r["step"] <= start_step] if self.path.exists() else []
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.last_step = kept[-1]["step"] if kept else 0
        """The last step whose row the file holds."""
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = run_dir / "tensorboard"
            if start_step == 0:
                shutil.rmtree(tb_dir, ignore_errors=True)
            self._tb = SummaryWriter(log_dir=str(tb_dir), purge_step=start_step + 1 if start_step else None)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def log_due(step: int, total: int, interval: int) -> bool:
    """Whether step `step` (1-based) of `total` prints its progress line: every `logging.log_interval`
    steps, and always the last."""
    return step % interval == 0 or step == total


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
