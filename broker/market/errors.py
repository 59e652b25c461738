"""Errors of the market: refused asks and benchmark reports (the previous valid ask stands)."""
from __future__ import annotations

from broker.auction.errors import AuctionError


class MarketError(AuctionError):
    code = "market_error"
    title = "Market error"


class PluginNotServed(MarketError):
    """An ask for a plugin the agent did not declare in its capabilities."""

    code = "plugin_not_served"
    http_status = 422
    grpc_status = "FAILED_PRECONDITION"
    title = "Plugin not served"


class InvalidBenchmark(MarketError):
    """A benchmark report with an impossible value (negative, zero, not finite, absurd)."""

    code = "invalid_benchmark"
    http_status = 422
    grpc_status = "INVALID_ARGUMENT"
    title = "Invalid benchmark"


class InvalidMarketRule(MarketError):
    """An admin's market rule out of range (a reputation floor outside 0..1)."""

    code = "invalid_market_rule"
    http_status = 422
    grpc_status = "INVALID_ARGUMENT"
    title = "Invalid market rule"
