"""Checks on a standing ask before it enters the book. A refused ask raises
:class:`InvalidAsk` naming the field, the bad value and what is allowed; the book is left
untouched, so the provider's previous valid ask stands.

Every check reads one field (and the rules), so an ask made from a valid one by changing
some fields is valid exactly when the changed fields are: :func:`validate_fields` checks only
those, which is what the book does for the capacity changes it gets on every job.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Collection
from numbers import Real

from .errors import InvalidAsk
from .model import Ask, AuctionRules


def _is_real(value) -> bool:
    # float and int first: the ABC check behind isinstance(…, Real) costs more than the
    # rest of a check, and nearly every value is one of the two (bool is neither type).
    return type(value) in (float, int) or (not isinstance(value, bool) and isinstance(value, Real))


def _finite(low: float, high: Callable[[AuctionRules], float],
            what: Callable[[AuctionRules], str]):
    """A check that the field is a finite real number from ``low`` to ``high(rules)``;
    ``what(rules)`` says what is allowed (formatted only when the check fails)."""
    def check(ask: Ask, name: str, value, rules: AuctionRules) -> None:
        if not (_is_real(value) and math.isfinite(value) and low <= value <= high(rules)):
            raise InvalidAsk(name, value, what(rules), provider_id=ask.provider_id)
    return check


def _non_empty(ask: Ask, name: str, value, rules: AuctionRules) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidAsk(name, value, "a non-empty string", provider_id=ask.provider_id or None)


def _price(ask: Ask, name: str, value, rules: AuctionRules) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not (
            0 < value <= rules.max_ask_micro_per_unit):
        raise InvalidAsk(name, value,
                         f"an integer from 1 to {rules.max_ask_micro_per_unit:,} micro-credits "
                         "per work unit (zero, negative and absurd prices are refused)",
                         provider_id=ask.provider_id)


def _slots(ask: Ask, name: str, value, rules: AuctionRules) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= rules.max_slots:
        raise InvalidAsk(name, value, f"an integer from 0 to {rules.max_slots}",
                         provider_id=ask.provider_id)


def _linked(ask: Ask, name: str, value, rules: AuctionRules) -> None:
    if not isinstance(value, frozenset):
        raise InvalidAsk(name, value, "a frozenset of account ids", provider_id=ask.provider_id)


def _expiry(ask: Ask, name: str, value, rules: AuctionRules) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, Real)
                              or math.isnan(value)):
        raise InvalidAsk(name, value, "None or a time in epoch seconds",
                         provider_id=ask.provider_id)


#: The checks, in the order they run (the first failing one is the error reported). Fields
#: not listed (``throughput_measured``, ``online``) take any value.
_CHECKS: dict[str, Callable[[Ask, str, object, AuctionRules], None]] = {
    "provider_id": _non_empty,
    "operator_id": _non_empty,
    "plugin": _non_empty,
    "plugin_version": _non_empty,
    "weights_digest": _non_empty,
    "price_micro_per_unit": _price,
    "throughput_units_per_s": _finite(
        0.0, lambda r: r.max_throughput_units_per_s,
        lambda r: f"a finite number from 0 to {r.max_throughput_units_per_s:g} work units/s "
                  "(a benchmark outside that range is impossible)"),
    "queue_s": _finite(
        0.0, lambda r: r.max_queue_s,
        lambda r: f"a finite number of seconds from 0 to {r.max_queue_s:g}"),
    "cold_start_s": _finite(
        0.0, lambda r: r.max_cold_start_s,
        lambda r: f"a finite number of seconds from 0 to {r.max_cold_start_s:g}"),
    "reliability": _finite(0.0, lambda r: 1.0, lambda r: "a probability from 0 to 1"),
    "reputation": _finite(-math.inf, lambda r: math.inf, lambda r: "a finite number"),
    "vram_gb": _finite(
        0.0, lambda r: r.max_vram_gb,
        lambda r: f"a finite number of GB from 0 to {r.max_vram_gb:g}"),
    "slots_free": _slots,
    "linked_accounts": _linked,
    "expires_at_s": _expiry,
}


#: The rules the checks read: asks valid under some rules are valid under others that agree
#: on these.
_BOUNDS = ("max_ask_micro_per_unit", "max_throughput_units_per_s", "max_queue_s",
           "max_cold_start_s", "max_vram_gb", "max_slots")


def same_checks(a: AuctionRules, b: AuctionRules) -> bool:
    """Whether an ask valid under rules ``a`` is valid under rules ``b``."""
    return all(getattr(a, name) == getattr(b, name) for name in _BOUNDS)


def validate_ask(ask: Ask, rules: AuctionRules) -> None:
    """Raise :class:`InvalidAsk` unless ``ask`` is well formed and plausible under ``rules``."""
    for name, check in _CHECKS.items():
        check(ask, name, getattr(ask, name), rules)


def validate_fields(ask: Ask, names: Collection[str], rules: AuctionRules) -> None:
    """:func:`validate_ask` limited to the fields in ``names``: enough for an ask made by
    changing those fields of an ask that was valid (the same error as the full check)."""
    for name, check in _CHECKS.items():
        if name in names:
            check(ask, name, getattr(ask, name), rules)
