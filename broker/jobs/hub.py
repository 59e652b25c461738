"""EventHub: wakes threads waiting on a job (long-poll GETs, server-sent event streams).

The events themselves live in the database; the hub only says "something happened to job
X", so a waiter re-reads. One condition variable with a version per job keeps it simple.
"""
from __future__ import annotations

import threading
import time


class EventHub:
    def __init__(self):
        self._cond = threading.Condition()
        self._versions: dict[str, int] = {}

    def version(self, job_id: str) -> int:
        with self._cond:
            return self._versions.get(job_id, 0)

    def notify(self, job_id: str) -> None:
        with self._cond:
            self._versions[job_id] = self._versions.get(job_id, 0) + 1
            if len(self._versions) > 100_000:
                self._versions.clear()
            self._cond.notify_all()

    def wait(self, job_id: str, seen_version: int, timeout_s: float) -> int:
        """Block until the job's version differs from ``seen_version`` or the timeout passes;
        returns the current version."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._versions.get(job_id, 0) == seen_version:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._versions.get(job_id, 0)
