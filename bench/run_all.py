"""`make bench`: every benchmark in turn with its default sizes; each prints its own ratios, records
the ones it gates (`gate.record`), and this compares them with the committed baseline.

python bench/run_all.py [NAME ...]                  # e.g. `rl_loop weight_sync` runs only those two
python bench/run_all.py --repeat 3 --write-baseline  # measure the noise and write bench/baseline.json

Exit 1 when a benchmark failed or a gated ratio fell by more than 20% from the baseline (one line
per ratio, `gate.compare`); the ratios of this run are in `--results` (JSON lines).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gate import BASELINE, RESULTS_ENV, baseline_from, compare, read_results

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from tests import suite_clock  # noqa: E402  (the suite's time per tier: tests/suite_clock.py)

BENCHES = [
    "engine",
    "router",
    "router_start",
    "group_requests",
    "agent_endpoint",
    "packing",
    "trainer",
    "ppo_critic",
    "routing_replay",
    "export",
    "convert",
    "weight_sync",
    "rl_loop",
    "step_time",
]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"benchmarks to run (default: all of {', '.join(BENCHES)})"
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of each benchmark (the median counts)")
    parser.add_argument("--results", type=Path, default=HERE.parent / "runs" / "bench" / "results.jsonl")
    parser.add_argument("--baseline", type=Path, default=BASELINE, help="ratios to hold (committed)")
    parser.add_argument("--write-baseline", action="store_true", help="write --baseline from this run")
    parser.add_argument(
        "--suite-times",
        type=Path,
        default=suite_clock.SUITE_TIMES,
        help="the test suite's time per tier (written by `make test`); each tier's latest is gated",
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in BENCHES]
    if unknown:
        parser.exit(
            2,
            f"run_all.py: error: unknown benchmark {', '.join(unknown)}: choose from {', '.join(BENCHES)}\n",
        )
    if args.repeat < 1:
        parser.exit(2, f"run_all.py: error: --repeat {args.repeat}: must be at least 1\n")
    return args


def run_benches(names: list[str], repeat: int, results: Path) -> list[str]:
    """Run each benchmark `repeat` times, recording into `results`; the names of those that failed."""
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text("")
    env = {**os.environ, RESULTS_ENV: str(results)}
    failed = []
    for name in names:
        for run in range(1, repeat + 1):
            print(f"=== bench_{name} (run {run} of {repeat})", flush=True)
            start = time.monotonic()
            code = subprocess.call([sys.executable, str(HERE / f"bench_{name}.py")], cwd=HERE.parent, env=env)
            print(f"=== bench_{name}: exit {code} after {time.monotonic() - start:.0f} s", flush=True)
            if code and name not in failed:
                failed.append(name)
    return failed


def record_suite(suite_times: Path, results: Path) -> None:
    """Each tier's latest time from the test suite's runs, as ratios of the `suite` entry."""
    rows = suite_clock.latest(suite_times)
    if not rows:
        print(f"note: no test-suite times in {suite_times} (a passing `make test` writes them)")
        return
    for tier, entry in rows.items():
        units, when = entry["units"], entry["time"]
        print(f"=== suite tier {tier}: {entry['seconds']:.0f} s = {units:.0f} calibrations ({when})")
    with results.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps({"bench": "suite", "ratios": suite_clock.ratios(rows)}) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    failed = run_benches(args.names or BENCHES, args.repeat, args.results)
    record_suite(args.suite_times, args.results)
    runs = read_results(args.results)
    if args.write_baseline:
        args.baseline.write_text(json.dumps(baseline_from(runs), indent=1) + "\n")
        print(f"baseline written: {args.baseline}")
    baseline = json.loads(args.baseline.read_text()) if args.baseline.exists() else {}
    falls, notes = compare(runs, baseline)
    for line in notes:
        print(f"note: {line}")
    for line in falls:
        print(f"regression: {line}", file=sys.stderr)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or falls else 0


if __name__ == "__main__":
    sys.exit(main())
