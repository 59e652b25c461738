"""The broker's own throughput figure θ per (provider, plugin), in work units per second.

Samples come from real jobs (the signed receipt's work units over its ``run`` timing) and
from canary jobs. θ is an exponentially weighted mean of the samples; a claim (the agent's
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


def run_sample(receipt: dict, default_units: float) -> tuple[float, float] | None:
    """(work units, run ms) measured by a signed receipt, or None when it carries no usable
    run time — a receipt without timings must never count as infinitely fast."""
    timings = receipt.get("timings_ms") or {}
    run_ms = timings.get("run", timings.get("total"))
    # 0 is a real reading (a job under a millisecond; observe() floors it); absent is not.
    if isinstance(run_ms, bool) or not isinstance(run_ms, (int, float)) or not run_ms >= 0:
        return None
    try:
        units = float(receipt.get("work_units", default_units))
    except (TypeError, ValueError):
        units = default_units
    if not math.isfinite(units) or units <= 0:
        units = default_units
    return units, float(run_ms)
