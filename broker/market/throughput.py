"""The broker's own throughput figure θ per (provider, plugin), in work units per second.

Samples come from real jobs and from canary jobs, timed by the broker itself: the work
units the broker computed for the job's inputs (the receipt's own count only when it is
smaller: a job that stopped early) over the time from the assignment being sent to the
receipt arriving (:func:`timed_sample`). What the agent reports of its own timings counts
only as a bounded deduction for queueing, so a receipt claiming ten times the units in a
millisecond measures what the broker saw, not what it says. θ is an exponentially weighted mean of the samples; a claim (the agent's
benchmark) is kept beside it and **flagged** when it is more than ``overclaim_factor`` times
what the broker measured. Matching uses the measured θ as soon as one sample exists.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

Key = tuple[str, str]  # (provider id, plugin)


@dataclass
class ThroughputRecord:
    claimed_units_per_s: float | None = None
    measured_units_per_s: float | None = None
    samples: int = 0
    successes: int = 0
    failures: int = 0
    flagged: bool = False

    @property
    def reliability(self) -> float:
        """Share of finished attempts that succeeded; 1.0 until there are any (a Laplace
        prior of one success keeps a single early failure from ruling a provider out)."""
        return (self.successes + 1) / (self.successes + self.failures + 1)


class ThroughputTracker:
    def __init__(self, *, alpha: float = 0.3, overclaim_factor: float = 2.0,
                 min_run_ms: float = 1.0):
        self.alpha = alpha
        self.overclaim_factor = overclaim_factor
        self.min_run_ms = min_run_ms  # timings below this are clamped (clock resolution)
        self._records: dict[Key, ThroughputRecord] = {}

    def record_of(self, provider_id: str, plugin: str) -> ThroughputRecord:
        return self._records.setdefault((provider_id, plugin), ThroughputRecord())

    def claim(self, provider_id: str, plugin: str, units_per_s: float) -> None:
        rec = self.record_of(provider_id, plugin)
        rec.claimed_units_per_s = units_per_s
        self._flag(rec)

    def observe(self, provider_id: str, plugin: str, work_units: float, run_ms: float) -> float | None:
        """Add one timed run; returns the new θ (None for a sample that says nothing)."""
        if not (math.isfinite(work_units) and work_units > 0 and math.isfinite(run_ms)
                and run_ms >= 0):
            return None
        rate = work_units / (max(run_ms, self.min_run_ms) / 1000.0)
        rec = self.record_of(provider_id, plugin)
        rec.successes += 1
        rec.samples += 1
        if rec.measured_units_per_s is None:
            rec.measured_units_per_s = rate
        else:
            rec.measured_units_per_s += self.alpha * (rate - rec.measured_units_per_s)
        self._flag(rec)
        return rec.measured_units_per_s

    def failed(self, provider_id: str, plugin: str) -> None:
        self.record_of(provider_id, plugin).failures += 1

    def _flag(self, rec: ThroughputRecord) -> None:
        rec.flagged = (rec.claimed_units_per_s is not None and rec.measured_units_per_s is not None
                       and rec.claimed_units_per_s > self.overclaim_factor * rec.measured_units_per_s)

    def theta(self, provider_id: str, plugin: str) -> tuple[float, bool]:
        """(θ, measured?): the broker's figure when it has one, else the claim (or 0)."""
        rec = self._records.get((provider_id, plugin))
        if rec is None:
            return 0.0, False
        if rec.measured_units_per_s is not None:
            return rec.measured_units_per_s, True
        return rec.claimed_units_per_s or 0.0, False

    def snapshot(self) -> dict[Key, ThroughputRecord]:
        return dict(self._records)


#: At most this share of the time the broker saw may be deducted as queueing the agent
#: reports (``timings_ms.queue``): an agent that claims every millisecond was queueing can
#: look at most 1 / (1 − share) times faster than the broker saw it run.
MAX_QUEUE_SHARE = 0.5


def timed_sample(receipt: dict, units_asked: float, sent_at: float | None,
                 received_at: float | None, *,
                 max_queue_share: float = MAX_QUEUE_SHARE) -> tuple[float, float] | None:
    """(work units, run ms) of one run as the broker timed it, or None when it cannot be.

    ``units_asked``: the work units the broker computed for the job's inputs; the receipt's
    ``work_units`` count only when they are fewer (a text job that ended early), never
    more. ``sent_at``/``received_at``: when the broker sent the assignment and when the
    receipt reached it (its own clock, epoch seconds). The agent's ``timings_ms.queue`` (time
    the job waited on the agent before it ran) is deducted, but never more than
    ``max_queue_share`` of the time seen; its ``run`` timing is not read at all."""
    if sent_at is None or received_at is None:
        return None
    seen_ms = (float(received_at) - float(sent_at)) * 1000.0
    try:
        asked = float(units_asked)
    except (TypeError, ValueError):
        return None
    if not (math.isfinite(seen_ms) and seen_ms >= 0 and math.isfinite(asked) and asked > 0):
        return None
    units = asked
    claimed = receipt.get("work_units")
    if not isinstance(claimed, bool):
        try:
            claimed = float(claimed)
        except (TypeError, ValueError):
            claimed = None
        if claimed is not None and math.isfinite(claimed) and 0 < claimed < asked:
            units = claimed
    queue = (receipt.get("timings_ms") or {}).get("queue", 0) \
        if isinstance(receipt.get("timings_ms"), dict) else 0
    if isinstance(queue, bool) or not isinstance(queue, (int, float)) or not queue >= 0 \
            or not math.isfinite(queue):
        queue = 0.0
    return units, seen_ms - min(float(queue), max(0.0, min(1.0, max_queue_share)) * seen_ms)
