"""Retention of job blobs (DESIGN §7: everything stored has a retention time).

One sweep, on the local folder and on S3 alike, run by the broker's maintenance thread every
``interval_s``. A blob is deleted when nothing live needs it and one of these holds:

- **expired output**: it is an output only of jobs that ended more than
  ``output_retention_s`` ago (0: outputs are kept for ever);
- **checkpoint of an ended job**: it is a checkpoint only of jobs that are over (settled,
  failed, cancelled, refunded): nothing resumes from it any more;
- **orphan**: nothing names it (an upload whose receipt never came, a canary's output, the
  outputs a verification overturned) and it is older than ``orphan_grace_s``.

"Live" is an output of a job not yet ended or ended within the retention time, or a
checkpoint of a job not yet ended. Blobs are content-addressed, so two jobs with the same
output share one blob: it lives as long as the longest-lived of them. Each candidate's
references are read again just before it is deleted, so a receipt that settled meanwhile
keeps its outputs. Several replicas may sweep at once: deleting twice is no error.

Outputs past their retention answer 410 ``output_expired`` (the job still says which they
were). The sweep lists the whole store each time (O(blobs)); for buckets far larger than one
listing every few minutes, an S3 lifecycle rule expiring objects after the retention time
can stand in for the age-based part (docs/architecture.md, *Blob store*).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Protocol

log = logging.getLogger(__name__)


class BlobReferences(Protocol):
    """What the sweep reads of the jobs (broker.storage.retention_sql)."""

    def live(self, output_cutoff: float | None) -> set[str]:
        """Blobs that must stay: outputs of jobs not ended or ended at/after
        ``output_cutoff`` (None: every output), and checkpoints of jobs not ended."""

    def named(self) -> set[str]:
        """Blobs any job names at all (outputs and checkpoints)."""

    def live_among(self, keys: Iterable[str], output_cutoff: float | None) -> set[str]:
        """:meth:`live`, only for ``keys`` (the re-check before deleting)."""


@dataclass
class RetentionPolicy:
    output_retention_s: float = 7 * 24 * 3600.0   # 0: keep outputs for ever
    orphan_grace_s: float = 3600.0
    interval_s: float = 300.0

    def __post_init__(self):
        for name in ("output_retention_s", "orphan_grace_s", "interval_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class SweepReport:
    at: float
    blobs: int = 0          # stored after the sweep
    bytes: int = 0
    deleted: int = 0
    freed_bytes: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


class BlobRetention:
    def __init__(self, blobs, refs: BlobReferences, policy: RetentionPolicy | None = None,
                 clock=time.time):
        self.blobs = blobs
        self.refs = refs
        self.policy = policy or RetentionPolicy()
        self.clock = clock
        self.last: SweepReport | None = None
        self._lock = threading.Lock()
        self._next_at = 0.0

    def output_cutoff(self, now: float | None = None) -> float | None:
        """Outputs of jobs that ended before this have expired (None: they never do)."""
        if not self.policy.output_retention_s:
            return None
        return (self.clock() if now is None else now) - self.policy.output_retention_s

    def expired(self, finished_at: float | None, now: float | None = None) -> bool:
        """Whether the outputs of a job that ended at ``finished_at`` are past retention."""
        cutoff = self.output_cutoff(now)
        return cutoff is not None and finished_at is not None and finished_at < cutoff

    def due(self) -> None:
        """The maintenance thread's task: a sweep when ``interval_s`` has passed."""
        if self.clock() >= self._next_at:
            self.sweep()

    def sweep(self) -> SweepReport:
        """Delete what retention no longer keeps; returns what was done and what is left."""
        with self._lock:  # one sweep at a time in this process
            t0 = time.perf_counter()
            now = self.clock()
            self._next_at = now + self.policy.interval_s
            cutoff = self.output_cutoff(now)
            live = self.refs.live(cutoff)
            named = self.refs.named()
            report = SweepReport(at=now)
            candidates: dict[str, tuple[int, str]] = {}
            for b in self.blobs.blobs():
                if b.key in live:
                    report.blobs += 1
                    report.bytes += b.size
                elif b.key in named:  # an expired output or a spent checkpoint
                    candidates[b.key] = (b.size, "expired")
                elif now - b.modified_at >= self.policy.orphan_grace_s:
                    candidates[b.key] = (b.size, "orphan")
                else:  # an upload whose receipt may still come
                    report.blobs += 1
                    report.bytes += b.size
            revived = self.refs.live_among(list(candidates), cutoff) if candidates else set()
            for key, (size, reason) in candidates.items():
                if key in revived:
                    report.blobs += 1
                    report.bytes += size
                    continue
                try:
                    self.blobs.delete(key)
                except Exception:  # noqa: BLE001 - the next sweep tries again
                    log.exception("retention: deleting blob %s failed", key)
                    report.blobs += 1
                    report.bytes += size
                    continue
                report.deleted += 1
                report.freed_bytes += size
                report.by_reason[reason] = report.by_reason.get(reason, 0) + 1
            report.seconds = time.perf_counter() - t0
            self.last = report
        if report.deleted:
            log.info("retention: deleted %d blob(s), %d bytes (%s); %d blob(s), %d bytes kept",
                     report.deleted, report.freed_bytes,
                     ", ".join(f"{n} {r}" for r, n in sorted(report.by_reason.items())),
                     report.blobs, report.bytes)
        return report
