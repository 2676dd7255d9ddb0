"""One background thread that runs jobs in the order they were submitted.

A streaming checkpoint writer spends about half its time in the kernel copying bytes into the page
cache, with the GIL released; handing those writes to this thread lets the next tensor be
produced (Python work) at the same time. Jobs are bounded by the bytes they hold, so memory stays
at about `max_pending_bytes` beyond what the caller holds anyway.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class SerialWorker:
    def __init__(self, max_pending_bytes: int = 64 * 1024**2) -> None:
        self.max_pending_bytes = max_pending_bytes
        self._jobs: queue.Queue[tuple[Callable[[], None], int] | None] = queue.Queue()
        self._room = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None], nbytes: int = 0) -> None:
        """Queue `job` (which keeps `nbytes` alive until it has run); raises an earlier job's error."""
        with self._room:
            while self._pending and self._pending + nbytes > self.max_pending_bytes and not self._error:
                self._room.wait()
            if self._error is not None:
                raise self._error
            self._pending += nbytes
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="slimrl-writer", daemon=True)
            self._thread.start()
        self._jobs.put((job, nbytes))

    def drain(self) -> None:
        """Wait for every queued job, stop the thread, and raise the first job error if any
        (a failed worker stays failed: the rest of its jobs were skipped)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, nbytes = item
            failure = None
            try:
                if self._error is None:  # after a failure the rest is skipped, not half-done
                    job()
            except BaseException as exc:  # re-raised in the submitting thread
                failure = exc
            with self._room:
                self._error = self._error or failure
                self._pending -= nbytes
                self._room.notify_all()
