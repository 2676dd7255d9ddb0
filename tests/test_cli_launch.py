"""The converter's own launcher: a failing rank stops its siblings instead of leaving them hung."""

from __future__ import annotations

import subprocess
import sys
import time

from slimrl.conversion.cli import _wait_all


def test_first_failure_stops_the_other_ranks():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    start = time.perf_counter()
    assert _wait_all([sleeper, failing]) == 1
    assert time.perf_counter() - start < 20
    assert failing.returncode == 3 and sleeper.returncode is not None and sleeper.returncode != 0


def test_all_ranks_succeeding_is_success():
    procs = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    assert _wait_all(procs) is None
    assert [p.returncode for p in procs] == [0, 0]


def parse(tmp_path, *flags: str, layers: int = 6):
    from slimrl.conversion.cli import build_parser

    (tmp_path / "config.json").write_text(f'{{"num_hidden_layers": {layers}}}')
    return build_parser().parse_args(["hf-to-mcore", "--hf-dir", str(tmp_path), "--out", "x", *flags])


def test_auto_workers_fill_the_cores_within_the_layers(tmp_path, monkeypatch):
    from slimrl.conversion.cli import resolve_workers

    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(16)))
    assert resolve_workers(parse(tmp_path), inside=False) == 6  # one per layer
    assert resolve_workers(parse(tmp_path, layers=64), inside=False) == 8  # the cap
    assert resolve_workers(parse(tmp_path, "--tp", "4", layers=64), inside=False) == 4  # 16 cores / 4
    assert resolve_workers(parse(tmp_path, "--pp", "2"), inside=False) == 3  # 6 layers / 2 stages
    assert resolve_workers(parse(tmp_path, "--workers", "5"), inside=False) == 5  # explicit wins
    monkeypatch.setenv("WORLD_SIZE", "8")  # joining a launched job: its size decides, on every rank
    assert resolve_workers(parse(tmp_path, "--tp", "2"), inside=True) == 4
