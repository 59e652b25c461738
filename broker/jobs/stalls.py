"""StallWatch: takes back jobs that run far longer than they should (DESIGN §2).

Heartbeats only say that an agent is alive, not that its job is moving: a wedged plugin
host, or an agent that keeps heartbeating while its host is stuck, would hold a job for
ever. A leased job whose attempt has run past its bound is requeued like an expired lease
(attempt + 1, provider excluded, resumed from its last checkpoint), or failed with a full
refund once attempts or the deadline run out.

Bound of an attempt = ``factor`` × max(the manifest's ``wall_clock_s``, the expected
duration) + the lease timeout. The expected duration comes from ``expected_s(job)``: work
units over the throughput θ the broker measured for the provider (None while unknown).
The leased jobs are scanned every ``scan_interval_s`` (5 s), so a stalled job is taken
back up to that long after its bound.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from .model import LEASED, Job

log = logging.getLogger(__name__)


@dataclass
class StallSettings:
    factor: float = 1.5
    min_bound_s: float = 5.0
    # Leased jobs are read at most this often (bounds are minutes; reading thousands of
    # leased jobs on every half-second reap cost a busy replica more than its heartbeats).
    scan_interval_s: float = 5.0


class StallWatch:
    def __init__(self, wall_clock_s: Callable[[Job], float | None],
                 expected_s: Callable[[Job], float | None] = lambda job: None,
                 settings: StallSettings | None = None, clock=time.time,
                 leased: Callable[[], list[Job]] | None = None):
        self.wall_clock_s = wall_clock_s
        self.expected_s = expected_s
        self.settings = settings or StallSettings()
        self.clock = clock
        self.leased = leased  # all leased jobs (SQL: one query); None: nothing to watch
        self._scanned_at = float("-inf")

    def bound_s(self, job: Job, lease_timeout_s: float) -> float:
        wall = self.wall_clock_s(job) or 0.0
        expected = self.expected_s(job) or 0.0
        return max(self.settings.min_bound_s,
                   self.settings.factor * max(wall, expected) + lease_timeout_s)

    def reap(self, jobs) -> list[Job]:
        """Requeue (or fail) every leased job past its bound; ``jobs`` is the JobService."""
        if self.leased is None:
            return []
        now, moved = self.clock(), []
        if now - self._scanned_at < self.settings.scan_interval_s:
            return []
        self._scanned_at = now
        for job in self.leased():
            if job.state not in LEASED:
                continue
            since = job.matched_at or job.started_at
            if since is None:
                continue
            bound = self.bound_s(job, jobs.settings.lease_timeout_s)
            if now - since <= bound:
                continue
            log.warning("job %s has run %.0fs on provider %s, past its bound of %.0fs; "
                        "taking it back", job.id, now - since, job.provider_id, bound)
            result = jobs.take_back(job, "stalled", f"ran {now - since:.0f}s, past its bound "
                                    f"of {bound:.0f}s on provider {job.provider_id}")
            if result is not None:
                moved.append(result)
        return moved
