"""`make bench`'s regression gate (bench/gate.py, bench/run_all.py): ratios recorded by each
benchmark, compared with the committed baseline, one line per ratio that fell by more than 20%."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests import suite_clock
from tests.conftest import PYTHON, REPO

sys.path.insert(0, str(REPO / "bench"))
import gate
import run_all


def test_a_ratio_that_fell_by_more_than_the_gate_fails_in_one_line():
    """The issue's example: the conversion core fell from 0.64x to 0.45x of the safetensors proxy
    (-30%): one line naming the benchmark, the ratio, both values and the fall. A fall of 14%
    passes; a ratio whose baseline runs spread by more than half the gate is reported, not gated."""
    baseline = {
        "convert": {
            "w1_hf_to_mcore_core_vs_proxy": {"value": 0.64, "noise": 0.05, "runs": 3},
            "w1_mcore_to_hf_core_vs_proxy": {"value": 0.64, "noise": 0.05, "runs": 3},
            "w2_hf_to_mcore_cli_vs_proxy": {"value": 0.5, "noise": 0.3, "runs": 3},
        }
    }
    runs = {
        "convert": {
            "w1_hf_to_mcore_core_vs_proxy": [0.45],
            "w1_mcore_to_hf_core_vs_proxy": [0.55],
            "w2_hf_to_mcore_cli_vs_proxy": [0.2],
            "w2_mcore_to_hf_cli_vs_proxy": [0.3],
        }
    }
    failures, notes = gate.compare(runs, baseline)
    assert failures == [
        "bench_convert w1_hf_to_mcore_core_vs_proxy: 0.45, baseline 0.64 (-30%; the gate is -20%)"
    ]
    assert notes == [
        "bench_convert w2_hf_to_mcore_cli_vs_proxy: 0.2, baseline 0.5 (-60%; not gated: its noise 30% > 10%)",
        "bench_convert w2_mcore_to_hf_cli_vs_proxy: 0.3 (not in the baseline)",
    ]


def test_the_baseline_is_the_median_of_the_runs_and_their_spread(tmp_path, monkeypatch):
    monkeypatch.setenv(gate.RESULTS_ENV, str(tmp_path / "results.jsonl"))
    for value in (0.60, 0.66, 0.63):
        gate.record("convert", {"core": value})
    runs = gate.read_results(tmp_path / "results.jsonl")
    assert runs == {"convert": {"core": [0.60, 0.66, 0.63]}}
    assert gate.baseline_from(runs) == {"convert": {"core": {"value": 0.63, "noise": 0.0952, "runs": 3}}}
    with pytest.raises(ValueError, match=r"bench_convert: ratios must be positive"):
        gate.record("convert", {"core": 0.0})


def test_every_benchmark_of_make_bench_records_its_ratios():
    for name in run_all.BENCHES:
        source = (REPO / "bench" / f"bench_{name}.py").read_text()
        assert re.search(rf'\brecord\(\s*"{name}"', source), f"bench_{name}.py records nothing"


def test_the_committed_baseline_gates_what_the_benchmarks_record():
    """Every gated ratio was measured at least 3 times, and its spread is within half the gate."""
    baseline = json.loads(gate.BASELINE.read_text())
    assert set(baseline) - {"suite"} == set(run_all.BENCHES)  # `suite`: the test tiers' times
    for bench, ratios in baseline.items():
        for name, entry in ratios.items():
            assert entry["runs"] >= 3 and entry["value"] > 0, (bench, name)
    gated = [(b, n) for b, r in baseline.items() for n, e in r.items() if e["noise"] <= gate.MAX_NOISE]
    assert len(gated) >= len(baseline), gated  # at least one gated ratio per benchmark on average
    # the README's count ("are gated: 27 of 38") is the baseline's
    claim = re.search(r"are gated: (\d+) of (\d+)", (REPO / "README.md").read_text())
    assert claim is not None
    total = sum(len(r) for r in baseline.values())
    assert (int(claim[1]), int(claim[2])) == (len(gated), total)


def test_run_all_fails_naming_the_ratio_below_its_baseline(tmp_path):
    """A real benchmark run through `make bench`'s runner: its ratio lands in the results file and
    is compared with the baseline given (here one it cannot reach: exit 1, one line)."""
    baseline = tmp_path / "baseline.json"
    baseline.write_text(
        json.dumps({"packing": {"packed_efficiency": {"value": 1.5, "noise": 0.0, "runs": 3}}})
    )
    results = tmp_path / "results.jsonl"
    cmd = [PYTHON, "bench/run_all.py", "packing", "--results", str(results), "--baseline", str(baseline),
           "--suite-times", str(tmp_path / "no_suite.jsonl")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    efficiency = gate.read_results(results)["packing"]["packed_efficiency"]
    assert len(efficiency) == 1 and 0.95 <= efficiency[0] <= 1.0
    line = f"regression: bench_packing packed_efficiency: {efficiency[0]:.4g}, baseline 1.5 ("
    assert [x for x in proc.stderr.splitlines() if x.startswith("regression:")] == [
        f"{line}{efficiency[0] / 1.5 - 1:+.0%}; the gate is -20%)"
    ]
    assert "note: no test-suite times in" in proc.stdout
    failures, _ = gate.compare(
        {"packing": {"packed_efficiency": efficiency}}, json.loads(gate.BASELINE.read_text())
    )
    assert failures == []  # the committed baseline holds


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nosuch"], "unknown benchmark nosuch: choose from engine, "),
        (["--repeat", "0"], "--repeat 0: must be at least 1"),
    ],
)
def test_run_all_refuses_bad_input_in_one_line(args, message):
    proc = subprocess.run(
        [PYTHON, "bench/run_all.py", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("args", "markexpr", "keyword", "narrowed", "tier"),
    [
        (["tests"], "", "", False, "all"),
        (["tests/"], "not slow", "", False, "fast"),
        ([], "sglang", "", False, "sglang"),
        (["tests/test_config.py"], "", "", False, None),  # a narrower path
        (["tests"], "", "resume", False, None),  # -k
        (["tests"], "slow and not sglang", "", False, None),  # not a Makefile tier
        ([], "sglang", "", True, None),  # --collect-only, --lf or --deselect
    ],
)
def test_only_a_whole_tier_counts_as_the_suites_time(args, markexpr, keyword, narrowed, tier):
    assert suite_clock.tier_of(args, markexpr, keyword, narrowed) == tier


def test_a_suite_tier_slower_in_calibration_units_fails_the_gate_in_one_line(tmp_path):
    """The suite's time per tier in units of a workload timed in the same session: a tier that took
    30% more calibrations than its baseline fails; the machine being 40% slower that day alone
    (every time, the calibration's too) does not. The runner turns each tier's latest row into
    the `suite` ratios and gates them like any benchmark's."""
    times = tmp_path / "suite.jsonl"
    quiet = suite_clock.row("all", 1800.0, 1.5, 1500, 2)  # 1200 calibrations
    suite_clock.append(times, quiet)
    baseline = {"suite": {"all": {"value": 1000 / 1200, "noise": 0.05, "runs": 3}}}
    slow_day = suite_clock.row("all", 1800.0 * 1.4, 1.5 * 1.4, 1500, 2)
    suite_clock.append(times, slow_day)
    runs = {"suite": {k: [v] for k, v in suite_clock.ratios(suite_clock.latest(times)).items()}}
    assert gate.compare(runs, baseline) == ([], [])
    suite_clock.append(times, suite_clock.row("fast", 300.0, 1.5, 900, 2))
    suite_clock.append(times, suite_clock.row("all", 1800.0 * 1.3, 1.5, 1500, 2))
    runs = {"suite": {k: [v] for k, v in suite_clock.ratios(suite_clock.latest(times)).items()}}
    failures, notes = gate.compare(runs, baseline)
    assert failures == ["bench_suite all: 0.641, baseline 0.8333 (-23%; the gate is -20%)"]
    assert notes == ["bench_suite fast: 5 (not in the baseline)"]
