"""The rules an admin sets (the reputation floor), kept in the store and read back on
every replica, and the sealed asks read back for their owner and admins.

A part of :class:`broker.market.service.MarketService`.
"""
from __future__ import annotations

import math
from dataclasses import replace

from .errors import InvalidMarketRule


class MarketRules:
    """Admin rules and the reads of asks (a part of MarketService)."""

    # ---- rules (admins) ----------------------------------------------------------------
    def set_reputation_floor(self, floor: float, *, by: str = "admin") -> float:
        """Change the reputation floor at run time (stored: it outlives the broker).
        Raises :class:`InvalidMarketRule` unless it is a number from 0 to 1."""
        value = _floor(floor)
        # Stored first, outside the clearing lock: a failed write changes nothing.
        if self.store is not None:
            self.store.save_rule("reputation_floor", value, by, self.clock())
        with self._lock:
            before = self.rules.reputation_floor
            self.rules = replace(self.rules, reputation_floor=value)
            self.book.set_rules(self.rules)
        self.on_rule_changed("reputation_floor", before, value, by)
        if self.bus is not None:
            self.bus.publish("market_rule", {"rule": "reputation_floor"})
        return value

    def reload_rules(self) -> None:
        """Read the admin-set rules back from the store (changed on another replica)."""
        if self.store is None:
            return
        floor = self.store.load_rules().get("reputation_floor")
        if floor is None:
            return
        with self._lock:
            self.rules = replace(self.rules, reputation_floor=_floor(floor))
            self.book.set_rules(self.rules)

    def market_rules(self) -> dict:
        with self._lock:
            return {"reputation_floor": self.rules.reputation_floor,
                    "claimed_throughput_factor": self.rules.claimed_throughput_factor,
                    "default_cold_start_s": self.settings.default_cold_start_s,
                    "canary_interval_s": self.settings.canary_interval_s}

    # ---- reads (owner and admins only) -------------------------------------------------
    def asks(self, provider_ids: set[str] | None = None) -> list[dict]:
        """Every provider's asks with the facts the score uses. Stored asks of providers
        not connected since the broker started are listed too (``online`` false)."""
        with self._locks():
            rows = []
            floor = self.rules.reputation_floor
            for pid, state in self._providers.items():
                if provider_ids is not None and pid not in provider_ids:
                    continue
                for plugin, version in sorted(state.plugins.items()):
                    rec = self.tracker.record_of(pid, plugin)
                    posted = state.asks.get(plugin)
                    rows.append({
                        "provider_id": pid, "plugin": plugin, "version": version,
                        "price_micro_per_unit": posted if posted is not None
                        else self.reserve_of(plugin),
                        "at_reserve": posted is None, "online": self._session(pid) is not None,
                        "weights_digest": state.digests.get(plugin, ""),
                        "claimed_units_per_s": rec.claimed_units_per_s,
                        "measured_units_per_s": rec.measured_units_per_s,
                        "samples": rec.samples, "overclaim_flagged": rec.flagged,
                        "reliability": round(rec.reliability, 4),
                        "below_reputation_floor": rec.reliability < floor,
                        "queue_s": round(state.queue_s, 3),
                        "cold_start_s": round(self._cold_start_s(state, plugin), 3)})
            for pid, stored in self._stored_asks.items():
                if pid in self._providers or (provider_ids is not None
                                              and pid not in provider_ids):
                    continue
                for plugin, price in sorted(stored.items()):
                    rows.append({
                        "provider_id": pid, "plugin": plugin, "version": None,
                        "price_micro_per_unit": price, "at_reserve": False, "online": False,
                        "weights_digest": "", "claimed_units_per_s": None,
                        "measured_units_per_s": None, "samples": 0,
                        "overclaim_flagged": False, "reliability": None,
                        "below_reputation_floor": False, "queue_s": None,
                        "cold_start_s": None})
            return rows


def _floor(value) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0.0 <= value <= 1.0):
        raise InvalidMarketRule(
            f"reputation_floor must be a number from 0 to 1 (a share of attempts that "
            f"succeeded); got {value!r}", field="reputation_floor")
    return float(value)
