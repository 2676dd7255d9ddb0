"""The regression gate of `make bench`: ratios measured in one run, compared with a committed baseline.

Each benchmark calls `record(bench, ratios)` with the ratios it measured in that run against a
baseline or a hardware limit (never absolute times: those follow the machine), each oriented so
that higher is better (a lower-is-better figure is recorded as its reciprocal, named for it).
`run_all.py` names the results file, compares every recorded ratio with `bench/baseline.json`
and fails with one line per ratio that fell by more than `GATE`.

The baseline holds, per ratio, the median of `--repeat` runs and their spread (max - min over the
median): the noise a run-to-run comparison must clear. A ratio whose spread is more than half the
gate is recorded but not gated (`noisy`): a 20% fall would not stand out from it.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

RESULTS_ENV = "SLIMRL_BENCH_RESULTS"
GATE = 0.20
"""A ratio fails when it is below (1 - GATE) x its baseline."""
MAX_NOISE = GATE / 2
"""Only ratios whose baseline runs varied by at most this are gated: a 20% fall is then at least
twice what run-to-run variation produced (the measured spreads: docs/benchmarks.md)."""
BASELINE = Path(__file__).resolve().parent / "baseline.json"

Ratios = dict[str, float]


def record(bench: str, ratios: Ratios) -> None:
    """Append this run's ratios of `bench` (higher is better) to the results file `run_all.py`
    named; a benchmark run on its own records nothing."""
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    bad = {name: value for name, value in ratios.items() if not value > 0}
    if bad:
        raise ValueError(f"bench_{bench}: ratios must be positive, got {bad}")
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"bench": bench, "ratios": ratios}) + "\n")


def read_results(path: Path) -> dict[str, dict[str, list[float]]]:
    """bench -> ratio -> the values of every run recorded in the file, in order."""
    runs: dict[str, dict[str, list[float]]] = {}
    if not path.exists():
        return runs
    for line in path.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        for name, value in entry["ratios"].items():
            runs.setdefault(entry["bench"], {}).setdefault(name, []).append(float(value))
    return runs


def summarise(values: list[float]) -> dict[str, float]:
    """The median of a ratio's runs and their spread (max - min over the median)."""
    median = statistics.median(values)
    return {
        "value": round(median, 4),
        "noise": round((max(values) - min(values)) / median, 4),
        "runs": len(values),
    }


def baseline_from(runs: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, dict[str, float]]]:
    return {bench: {name: summarise(v) for name, v in sorted(r.items())} for bench, r in sorted(runs.items())}


def compare(runs: dict[str, dict[str, list[float]]], baseline: dict) -> tuple[list[str], list[str]]:
    """(failures, notes): one line per gated ratio that fell by more than GATE from its baseline;
    notes for ratios not in the baseline or too noisy to gate."""
    failures, notes = [], []
    for bench, ratios in sorted(runs.items()):
        for name, values in sorted(ratios.items()):
            value = statistics.median(values)
            base = baseline.get(bench, {}).get(name)
            if base is None:
                notes.append(f"bench_{bench} {name}: {value:.4g} (not in the baseline)")
                continue
            change = value / base["value"] - 1
            line = f"bench_{bench} {name}: {value:.4g}, baseline {base['value']:.4g} ({change:+.0%}"
            if base["noise"] > MAX_NOISE:
                notes.append(f"{line}; not gated: its noise {base['noise']:.0%} > {MAX_NOISE:.0%})")
            elif change < -GATE:
                failures.append(f"{line}; the gate is -{GATE:.0%})")
    return failures, notes
