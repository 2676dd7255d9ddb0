"""Curves of a run's metrics (`metrics.jsonl`) as a PNG: what the README shows for `make demo`."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from slimrl.errors import ConfigError


def read_series(metrics_path: Path, key: str) -> tuple[list[int], list[float]]:
    if not metrics_path.is_file():
        raise ConfigError(f"{metrics_path}: no metrics file (is this a run directory?)")
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    points = [(int(r["step"]), float(r[key])) for r in rows if key in r]
    if not points:
        keys = sorted({k for r in rows for k in r if k != "step"})
        raise ConfigError(f"{metrics_path}: no `{key}` values (keys: {', '.join(keys[:12])}, ...)")
    steps, values = zip(*points, strict=True)
    return list(steps), list(values)


def moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


COLORS = (("#9bbcdb", "#1f5a96"), ("#f0b49a", "#b8481c"), ("#a8d5a2", "#2e7d32"), ("#c9b3e0", "#6a3d9a"))
"""(raw values, trailing mean) per curve."""


def plot_metric(
    run_dir: Path, out: Path, keys: str | list[str] = "rollout/raw_reward", window: int = 10
) -> Path:
    """Raw values and their trailing mean over `window` steps, one pair of lines per key on one
    set of axes; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [keys] if isinstance(keys, str) else keys
    series = [(key, *read_series(Path(run_dir) / "metrics.jsonl", key)) for key in keys]
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    for (key, steps, values), (light, dark) in zip(series, COLORS * len(series), strict=False):
        mean = f"mean of last {window}" if len(keys) == 1 else f"{key}, mean of last {window}"
        ax.plot(steps, values, color=light, linewidth=1, label=key if len(keys) == 1 else None)
        ax.plot(steps, moving_average(values, window), color=dark, linewidth=2, label=mean)
    ax.set_xlabel("rollout step")
    ax.set_ylabel(keys[0] if len(keys) == 1 else "value")
    ax.set_title(f"{Path(run_dir).name}: {keys[0]}" if len(keys) == 1 else Path(run_dir).name)
    ax.xaxis.get_major_locator().set_params(integer=True)  # rollout steps
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        Path(tmp).unlink(missing_ok=True)
    return out
