"""Checks on a standing ask before it enters the book. A refused ask raises
:class:`InvalidAsk` naming the field, the bad value and what is allowed; the book is left
untouched, so the provider's previous valid ask stands."""
from __future__ import annotations

import math
from numbers import Real

from .errors import InvalidAsk
from .model import Ask, AuctionRules


def _finite_in(ask: Ask, name: str, low: float, high: float, what: str) -> None:
    value = getattr(ask, name)
    if (isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value)
            or not low <= value <= high):
        raise InvalidAsk(name, value, what, provider_id=ask.provider_id)


def validate_ask(ask: Ask, rules: AuctionRules) -> None:
    """Raise :class:`InvalidAsk` unless ``ask`` is well formed and plausible under ``rules``."""
    for name in ("provider_id", "operator_id", "plugin", "plugin_version", "weights_digest"):
        value = getattr(ask, name)
        if not isinstance(value, str) or not value:
            raise InvalidAsk(name, value, "a non-empty string", provider_id=ask.provider_id or None)
    price = ask.price_micro_per_unit
    if isinstance(price, bool) or not isinstance(price, int) or not (
            0 < price <= rules.max_ask_micro_per_unit):
        raise InvalidAsk("price_micro_per_unit", price,
                         f"an integer from 1 to {rules.max_ask_micro_per_unit:,} micro-credits "
                         "per work unit (zero, negative and absurd prices are refused)",
                         provider_id=ask.provider_id)
    _finite_in(ask, "throughput_units_per_s", 0.0, rules.max_throughput_units_per_s,
               f"a finite number from 0 to {rules.max_throughput_units_per_s:g} work units/s "
               "(a benchmark outside that range is impossible)")
    _finite_in(ask, "queue_s", 0.0, rules.max_queue_s,
               f"a finite number of seconds from 0 to {rules.max_queue_s:g}")
    _finite_in(ask, "cold_start_s", 0.0, rules.max_cold_start_s,
               f"a finite number of seconds from 0 to {rules.max_cold_start_s:g}")
    _finite_in(ask, "reliability", 0.0, 1.0, "a probability from 0 to 1")
    _finite_in(ask, "reputation", -math.inf, math.inf, "a finite number")
    _finite_in(ask, "vram_gb", 0.0, rules.max_vram_gb,
               f"a finite number of GB from 0 to {rules.max_vram_gb:g}")
    slots = ask.slots_free
    if isinstance(slots, bool) or not isinstance(slots, int) or not 0 <= slots <= rules.max_slots:
        raise InvalidAsk("slots_free", slots, f"an integer from 0 to {rules.max_slots}",
                         provider_id=ask.provider_id)
    if not isinstance(ask.linked_accounts, frozenset):
        raise InvalidAsk("linked_accounts", ask.linked_accounts, "a frozenset of account ids",
                         provider_id=ask.provider_id)
    if ask.expires_at_s is not None and (
            isinstance(ask.expires_at_s, bool) or not isinstance(ask.expires_at_s, Real)
            or math.isnan(ask.expires_at_s)):
        raise InvalidAsk("expires_at_s", ask.expires_at_s, "None or a time in epoch seconds",
                         provider_id=ask.provider_id)
