"""The background writer thread: order kept, memory bounded, failures surface in the caller."""

from __future__ import annotations

import threading
import time

import pytest

from slimrl.utils.serial_worker import SerialWorker


def test_jobs_run_in_order_off_the_calling_thread():
    worker, ran = SerialWorker(), []
    for i in range(50):
        worker.submit(lambda i=i: ran.append((i, threading.current_thread().name)), nbytes=10)
    worker.drain()
    assert [i for i, _ in ran] == list(range(50))
    assert {name for _, name in ran} == {"slimrl-writer"}
    worker.submit(lambda: ran.append((50, "")))  # usable again after a drain
    worker.drain()
    assert len(ran) == 51


def test_pending_bytes_stay_under_the_bound():
    worker, peak = SerialWorker(max_pending_bytes=100), []

    def slow() -> None:
        peak.append(worker._pending)
        time.sleep(0.002)

    for _ in range(30):
        worker.submit(slow, nbytes=40)
    worker.drain()
    assert max(peak) <= 80 and worker._pending == 0
    worker.submit(slow, nbytes=500)  # a job bigger than the bound still runs (alone)
    worker.drain()
    assert peak[-1] == 500


def test_a_failure_skips_the_rest_and_reaches_the_caller():
    worker, ran = SerialWorker(), []
    worker.submit(lambda: ran.append(1))
    worker.submit(lambda: (_ for _ in ()).throw(OSError("disk full")))
    worker.submit(lambda: ran.append(3))
    with pytest.raises(OSError, match="disk full"):
        worker.drain()
    assert ran == [1]
    with pytest.raises(OSError, match="disk full"):
        worker.submit(lambda: ran.append(4))
    assert ran == [1]
