"""EventHub: wakes threads waiting on a job (long-poll GETs, server-sent event streams).

The events themselves live in the database; the hub only says "something happened to job
X" (and whether that was its end), so a waiter re-reads when it needs to. The end may come
with the job as it was written (a settlement's row and outputs): while nothing else has
happened to the job since, a waiter takes that copy instead of reading it back. Each job
has its own waiters: a notification wakes only the threads watching that job (one shared
condition would wake every long-poll on every event and have each of them re-query the
database).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any


class EventHub:
    MAX_TRACKED = 100_000
    MAX_COPIES = 4096  # ended jobs' copies kept (the newest), for waiters about to read

    def __init__(self):
        self._lock = threading.Lock()
        self._versions: dict[str, int] = {}
        self._waiters: dict[str, list[threading.Event]] = {}
        self._ended: set[str] = set()
        self._copies: OrderedDict[str, tuple[int, Any]] = OrderedDict()

    def version(self, job_id: str) -> int:
        with self._lock:
            return self._versions.get(job_id, 0)

    def ended(self, job_id: str) -> bool:
        """Whether this process saw the job end (settled, failed, cancelled). False also
        when it ended elsewhere (another broker replica) or was forgotten: a waiter that
        must know for sure reads the database."""
        with self._lock:
            return job_id in self._ended

    def copy(self, job_id: str) -> Any:
        """What the job's end was notified with, if nothing has happened to it since."""
        with self._lock:
            held = self._copies.get(job_id)
            return held[1] if held and held[0] == self._versions.get(job_id, 0) else None

    def notify(self, job_id: str, ended: bool = False, copy: Any = None) -> None:
        """Something happened to ``job_id``; ``ended``: it reached a terminal state;
        ``copy``: the job as that end wrote it (see :meth:`copy`)."""
        with self._lock:
            if len(self._versions) > self.MAX_TRACKED:
                # Forgetting versions only makes a waiter re-read once too often.
                self._versions.clear()
                self._ended.clear()
                self._copies.clear()
            version = self._versions[job_id] = self._versions.get(job_id, 0) + 1
            if ended:
                self._ended.add(job_id)
            if copy is not None:
                self._copies[job_id] = (version, copy)
                if len(self._copies) > self.MAX_COPIES:
                    self._copies.popitem(last=False)
            else:
                self._copies.pop(job_id, None)
            waiters = self._waiters.pop(job_id, ())
        for ev in waiters:
            ev.set()

    def wait(self, job_id: str, seen_version: int, timeout_s: float) -> int:
        """Block until the job's version differs from ``seen_version`` or the timeout passes;
        returns the current version."""
        ev = threading.Event()
        with self._lock:
            current = self._versions.get(job_id, 0)
            if current != seen_version:
                return current
            self._waiters.setdefault(job_id, []).append(ev)
        ev.wait(timeout_s)
        with self._lock:
            waiting = self._waiters.get(job_id)
            if waiting and ev in waiting:
                waiting.remove(ev)
                if not waiting:
                    del self._waiters[job_id]
            return self._versions.get(job_id, 0)
