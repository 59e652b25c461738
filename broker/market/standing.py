"""What the market knows of each provider's past: measured throughput θ, reliability
(successes over attempts), overclaim flags, and their figures kept in the database
(:mod:`.figures`) so that a restart or another replica sees the same market.

A part of :class:`broker.market.service.MarketService`.
"""
from __future__ import annotations

import logging

from .builds import ANY_WEIGHTS
from .figures import Figures

log = logging.getLogger(__name__)


class MarketStanding:
    """Measurements and their stored figures (a part of MarketService)."""

    # ---- measurements ----------------------------------------------------------------
    def observe(self, provider_id: str, plugin: str, work_units: float, run_ms: float) -> None:
        """A timed run (a real job's receipt or a canary) on this provider."""
        self._links_ahead(provider_id)
        with self._locks():
            if self.tracker.observe(provider_id, plugin, work_units, run_ms) is None:
                return
            self._dirty.add((provider_id, plugin))
            first = self.tracker.record_of(provider_id, plugin).samples == 1
            state = self._providers.get(provider_id)
            if state is not None and self._session(provider_id) is not None:
                self._repost(state)
        if first:  # measured at last: other replicas now count it eligible, at once
            self.flush_figures(provider_id)

    def failed(self, provider_id: str, plugin: str) -> None:
        self._links_ahead(provider_id)
        with self._locks():
            self.tracker.failed(provider_id, plugin)
            self._dirty.add((provider_id, plugin))
            state = self._providers.get(provider_id)
            if state is not None and self._session(provider_id) is not None:
                self._repost(state)

    def theta(self, provider_id: str, plugin: str) -> tuple[float, bool]:
        with self._lock:
            return self.tracker.theta(provider_id, plugin)

    def measured_any(self, plugin: str, weights_digest: str = ANY_WEIGHTS) -> bool:
        """Has the broker measured any online provider of ``plugin`` (with those weights)?
        Until it has (a cold market), the dispatcher hands jobs out by the spine's rule at
        the reserve, to the providers :meth:`admitted`, and those jobs' receipts are the first
        measurements."""
        with self._locks():
            return any(self._session(pid) is not None and plugin in s.plugins
                       and (weights_digest == ANY_WEIGHTS
                            or s.digests.get(plugin) == weights_digest)
                       and self.tracker.theta(pid, plugin)[1]
                       for pid, s in self._providers.items())

    def flagged(self, provider_id: str, plugin: str) -> bool:
        with self._lock:
            return self.tracker.record_of(provider_id, plugin).flagged

    # ---- figures (issue #21) ----------------------------------------------------------
    def load_figures(self, rows) -> None:
        with self._lock:
            for f in rows:
                key = (f.provider_id, f.plugin)
                if key in self._dirty:
                    continue  # this process's own newer figures win until flushed
                rec = self.tracker.record_of(f.provider_id, f.plugin)
                rec.measured_units_per_s = f.measured_units_per_s
                rec.samples, rec.successes, rec.failures = f.samples, f.successes, f.failures
                rec.claimed_units_per_s = None
                rec.flagged = False
                if f.claimed_units_per_s is not None:  # sets the claim and its flag
                    self.tracker.claim(f.provider_id, f.plugin, f.claimed_units_per_s)
                if f.last_canary_at is not None:
                    self._last_canary[key] = max(f.last_canary_at,
                                                 self._last_canary.get(key, 0.0))

    def _reload_figures(self, provider_id: str) -> None:
        if self.figures is None:
            return
        try:
            self.flush_figures(provider_id)
            self.load_figures(self.figures.load_figures([provider_id]))
        except Exception:  # noqa: BLE001 - the figures in memory (if any) stand
            log.exception("could not read the stored figures of %s", provider_id)

    def flush_figures(self, provider_id: str | None = None) -> int:
        """Write the figures changed since the last flush (of one provider, or all); the
        maintenance thread calls it every pass. Returns how many rows were written."""
        if self.figures is None:
            return 0
        with self._lock:
            keys = [k for k in self._dirty if provider_id is None or k[0] == provider_id]
            if not keys:
                return 0
            self._dirty.difference_update(keys)
            rows = []
            for pid, plugin in keys:
                rec = self.tracker.record_of(pid, plugin)
                rows.append(Figures(pid, plugin, rec.claimed_units_per_s,
                                    rec.measured_units_per_s, rec.samples, rec.successes,
                                    rec.failures, self._last_canary.get((pid, plugin))))
        try:
            self.figures.save_figures(rows, self.clock())
        except Exception:
            with self._lock:
                self._dirty.update(keys)  # written next time
            log.exception("could not store the market's figures of %d provider(s)", len(rows))
            return 0
        return len(rows)
