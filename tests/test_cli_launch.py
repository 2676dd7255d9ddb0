"""The converter's own launcher: a failing rank stops its siblings instead of leaving them hung."""

from __future__ import annotations

import subprocess
import sys
import time

from slimrl.megatron_bridge.cli import _wait_all


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
