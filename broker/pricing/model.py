"""A plugin's price and the integer arithmetic of charges.

All money is ``int`` micro-credits. Work units are floats in manifests and receipts; they
are turned into exact fractions once (``Fraction(str(w))``) so that every charge is
reproducible to the micro-credit: the most a job can cost rounds *up* (the hold always
covers the charge), what a job is charged rounds *down* (never more than earned).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

BPS = 10_000  # basis points in 100 %


def exact_units(work_units: float | int | str) -> Fraction:
    """Work units as an exact fraction of their decimal text (``0.1`` is 1/10, not the float)."""
    units = Fraction(str(work_units))
    if units < 0:
        raise ValueError(f"work units are {work_units!r}; they cannot be negative")
    return units


@dataclass(frozen=True)
class PluginPrice:
    """What an admin sets per plugin.

    ``reserve_micro_per_unit``: the most a client pays per work unit (the auction's reserve,
    DESIGN §4); ``fee_bps``: the platform's share of each charge, in basis points;
    ``min_charge_micro``: the least a completed job costs; ``vesting_window_s``: how long
    the provider's share stays claw-back-able before it vests; ``cache_price_micro``: what a
    job answered from the result cache costs (issue #24; the fee is taken from it, the
    rest goes to the provider whose verified run is served)."""

    plugin: str
    reserve_micro_per_unit: int
    fee_bps: int
    min_charge_micro: int
    vesting_window_s: int
    cache_price_micro: int = 100
    updated_at: float = 0.0
    updated_by: str = ""
    is_default: bool = False

    def max_price_micro(self, work_units: float) -> int:
        """The hold for a job of ``work_units``: reserve × units rounded up, at least the
        minimum charge."""
        return max(self.min_charge_micro,
                   math.ceil(self.reserve_micro_per_unit * exact_units(work_units)))

    def charge_micro(self, rate_micro_per_unit: int, work_units: float | Fraction, *,
                     cap_micro: int, minimum: bool = True) -> int:
        """What a job that used ``work_units`` at ``rate`` costs: rounded down, at least the
        minimum charge when ``minimum``, never more than ``cap_micro`` (the hold)."""
        raw = math.floor(rate_micro_per_unit * Fraction(work_units) if isinstance(work_units, Fraction)
                         else rate_micro_per_unit * exact_units(work_units))
        if minimum:
            raw = max(raw, self.min_charge_micro)
        return min(raw, cap_micro)

    def fee_of(self, charge_micro: int) -> int:
        """The platform's fee in a charge, rounded down (the remainder is the provider's)."""
        return charge_micro * self.fee_bps // BPS


@dataclass(frozen=True)
class Quote:
    """What a job would cost, without running it. ``max_micro`` is the hold (the most it can
    cost); ``expected_micro`` what it costs at the reserve with the work units the manifest
    predicts; ``min_micro`` the least a completed job costs."""

    plugin: str
    version: str
    work_units: float
    min_micro: int
    expected_micro: int
    max_micro: int
    price: PluginPrice


# Built-in plugins until an admin sets a price. A work unit is a manifest's unit: echo ≈ one
# call, SD ≈ one step of one megapixel image, Llama ≈ one token.
_WEEK_S = 7 * 24 * 3600
DEFAULT_PRICES: dict[str, PluginPrice] = {
    "echo": PluginPrice("echo", reserve_micro_per_unit=1_000, fee_bps=1_000,
                        min_charge_micro=100, vesting_window_s=_WEEK_S, is_default=True),
    "sd15": PluginPrice("sd15", reserve_micro_per_unit=20_000, fee_bps=1_000,
                        min_charge_micro=10_000, vesting_window_s=_WEEK_S, is_default=True),
    "sdxl": PluginPrice("sdxl", reserve_micro_per_unit=40_000, fee_bps=1_000,
                        min_charge_micro=20_000, vesting_window_s=_WEEK_S, is_default=True),
    "llama": PluginPrice("llama", reserve_micro_per_unit=200, fee_bps=1_000,
                         min_charge_micro=1_000, vesting_window_s=_WEEK_S, is_default=True),
}
#: Any other plugin until priced.
FALLBACK = PluginPrice("*", reserve_micro_per_unit=10_000, fee_bps=1_000, min_charge_micro=1_000,
                       vesting_window_s=_WEEK_S, is_default=True)
