"""The suite's time per tier, in units of a fixed CPU workload timed in the same session, so that
`make bench` can gate it like any ratio (issue 25 part 6).

A tier's wall time follows the machine (this one's speed moved 40% between two quiet days), so it
is recorded beside `calibrate()`: the best of three runs of a fixed single-thread workload of the
suite's kind (interpreter work and a small torch matmul loop, ~0.3 s), timed when the session
starts and again when it ends, the faster of the two kept (session 26: one start-only sample taken
while a previous run's servers were shutting down read 20% slow, and the tier 20% fast).
`conftest.py` appends one row per whole-tier run that passed to `runs/bench/suite.jsonl`;
`bench/run_all.py` turns each tier's latest row into the ratio calibration / tier time (higher is
faster) and compares it with `bench/baseline.json` like the benchmarks' ratios.

Only whole tiers count: `pytest tests` (`all`), `-m "not slow"` (`fast`), `-m sglang` (`sglang`),
with no `-k` and no narrower path; anything else is a developer's partial run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SUITE_TIMES = REPO / "runs" / "bench" / "suite.jsonl"
TIERS = {"": "all", "not slow": "fast", "sglang": "sglang"}
"""`-m` expression -> tier name (the Makefile's `test`, `test-fast` and `test-sglang`)."""


def tier_of(args: list[str], markexpr: str, keyword: str, narrowed: bool = False) -> str | None:
    """The tier a pytest invocation runs, or None for a partial run (`narrowed`: an option that
    runs fewer tests or none: `--collect-only`, `--lf`, `--deselect`)."""
    whole = [a.rstrip("/") for a in args] in ([], ["tests"], [str(REPO / "tests")])
    if not whole or keyword or narrowed:
        return None
    return TIERS.get(markexpr.strip())


def workload() -> None:
    import torch

    total = 0
    for i in range(2_500_000):
        total += i * i % 7
    a = torch.full((256, 256), 0.5)
    for _ in range(300):
        a = torch.tanh(a @ a)


def calibrate(repeats: int = 3) -> float:
    """Seconds of `workload()`, the best of `repeats` (the least disturbed)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            workload()
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        torch.set_num_threads(threads)


def row(tier: str, seconds: float, calibration_s: float, passed: int, workers: int) -> dict[str, Any]:
    return {
        "tier": tier,
        "seconds": round(seconds, 1),
        "calibration_s": round(calibration_s, 4),
        "units": round(seconds / calibration_s, 1),
        "passed": passed,
        "workers": workers,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def append(path: Path, entry: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")


def latest(path: Path) -> dict[str, dict[str, Any]]:
    """Each tier's newest row."""
    rows: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                entry = json.loads(line)
                rows[entry["tier"]] = entry
    return rows


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Per tier, 1000 calibrations over the tier's time (higher: a faster suite), named by the tier."""
    return {tier: 1000.0 / entry["units"] for tier, entry in sorted(rows.items())}
