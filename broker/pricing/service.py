"""PricingService: reads and sets the admin's prices per plugin, and quotes jobs.

Every change goes through :meth:`PricingService.set_price` (the audit log hooks in there).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Protocol

from broker.cache import TtlCache
from broker.pricing.errors import InvalidPrice
from broker.pricing.model import BPS, DEFAULT_PRICES, FALLBACK, PluginPrice, Quote
from broker.ledger.model import MAX_AMOUNT_MICRO

MAX_VESTING_WINDOW_S = 365 * 24 * 3600
_FIELDS = ("reserve_micro_per_unit", "fee_bps", "min_charge_micro", "vesting_window_s",
           "cache_price_micro")


class PriceRepository(Protocol):
    def get(self, plugin: str) -> PluginPrice | None: ...
    def all(self) -> list[PluginPrice]: ...
    def put(self, price: PluginPrice) -> None:
        """Insert or replace the price of ``price.plugin``."""


class PricingService:
    # Every job reads its plugin's price several times (hold, settle, market reserve). A
    # short cache saves those queries; set_price clears it, so a change made through this
    # broker applies to the very next job, and one made on another replica within CACHE_S.
    CACHE_S = 2.0

    def __init__(self, repo: PriceRepository, clock=time.time, bus=None,
                 on_changed: Callable[[PluginPrice, PluginPrice, str], None] | None = None):
        """``bus`` (broker.replicas.ReplicaBus): a change made on another broker replica
        drops this one's cached price at once, not CACHE_S later. ``on_changed(before,
        after, by)`` is called after every change (the audit log hooks in here)."""
        self.repo = repo
        self.clock = clock
        self.bus = bus
        self.on_changed = on_changed or (lambda before, after, by: None)
        self._cache: TtlCache[str, PluginPrice | None] = TtlCache(self.CACHE_S)
        if bus is not None:
            bus.subscribe("price", lambda d: self._cache.invalidate(str(d.get("plugin"))))

    def price(self, plugin: str, *, fresh: bool = False) -> PluginPrice:
        """The admin's price of ``plugin``, else its built-in default, else the fallback
        (cached up to CACHE_S; ``fresh``: read from the store)."""
        found = self._cache.get(plugin, self.repo.get, fresh=fresh)
        if found is not None:
            return found
        default = DEFAULT_PRICES.get(plugin)
        if default is not None:
            return default
        return PluginPrice(plugin, FALLBACK.reserve_micro_per_unit, FALLBACK.fee_bps,
                           FALLBACK.min_charge_micro, FALLBACK.vesting_window_s,
                           FALLBACK.cache_price_micro, is_default=True)

    def prices(self, plugins: list[str]) -> list[PluginPrice]:
        """Prices of ``plugins`` plus any other plugin an admin priced, sorted by name."""
        names = sorted(set(plugins) | {p.plugin for p in self.repo.all()})
        return [self.price(n) for n in names]

    def set_price(self, plugin: str, changes: dict[str, Any], *, by: str) -> PluginPrice:
        """Set some or all of a plugin's price fields (the others keep their current value).
        The one way prices change."""
        if not isinstance(plugin, str) or not plugin or len(plugin) > 64:
            raise InvalidPrice(f"plugin is {plugin!r}; it must be a plugin name", field="plugin")
        if not isinstance(changes, dict) or not changes:
            raise InvalidPrice(f"send a JSON object with any of {list(_FIELDS)}")
        unknown = sorted(set(changes) - set(_FIELDS))
        if unknown:
            raise InvalidPrice(f"unknown field {unknown[0]!r}; allowed: {', '.join(_FIELDS)}",
                               field=unknown[0])
        limits = {"reserve_micro_per_unit": (1, MAX_AMOUNT_MICRO),
                  "fee_bps": (0, BPS - 1),
                  "min_charge_micro": (0, MAX_AMOUNT_MICRO),
                  "vesting_window_s": (0, MAX_VESTING_WINDOW_S),
                  "cache_price_micro": (0, MAX_AMOUNT_MICRO)}
        for name, value in changes.items():
            low, high = limits[name]
            if type(value) is not int or not low <= value <= high:
                raise InvalidPrice(f"{name} is {value!r}; it must be an integer from {low:,} to "
                                   f"{high:,}" + (" (micro-credits)" if "micro" in name else ""),
                                   field=name)
        current = self.price(plugin, fresh=True)  # merge onto the stored price, not a cached one
        values = {name: changes.get(name, getattr(current, name)) for name in _FIELDS}
        new = PluginPrice(plugin, **values, updated_at=self.clock(), updated_by=by)
        self.repo.put(new)
        self._cache.invalidate(plugin)
        if self.bus is not None:
            self.bus.publish("price", {"plugin": plugin})
        self.on_changed(current, new, by)
        return new

    def quote(self, plugin: str, version: str, work_units: float) -> Quote:
        price = self.price(plugin)
        max_micro = price.max_price_micro(work_units)
        expected = price.charge_micro(price.reserve_micro_per_unit, work_units, cap_micro=max_micro)
        return Quote(plugin=plugin, version=version, work_units=work_units,
                     min_micro=min(price.min_charge_micro, max_micro), expected_micro=expected,
                     max_micro=max_micro, price=price)


def price_to_json(p: PluginPrice) -> dict:
    return {"plugin": p.plugin, "reserve_micro_per_unit": p.reserve_micro_per_unit,
            "fee_bps": p.fee_bps, "min_charge_micro": p.min_charge_micro,
            "vesting_window_s": p.vesting_window_s, "default": p.is_default,
            "updated_at": p.updated_at or None, "updated_by": p.updated_by or None}
