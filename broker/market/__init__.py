"""The market as the broker runs it (DESIGN §4): providers' standing asks kept in the
auction's order book, the broker's own throughput measurements θ per (provider, plugin),
and canary jobs. ``broker/auction`` holds the rules; this package feeds them live facts.
Plain Python: no Flask, grpc or SQLAlchemy.
"""
from .errors import InvalidBenchmark, InvalidMarketRule, MarketError, PluginNotServed
from .service import MarketService, MarketSettings
from .throughput import ThroughputTracker

__all__ = ["InvalidBenchmark", "InvalidMarketRule", "MarketError", "MarketService",
           "MarketSettings", "PluginNotServed", "ThroughputTracker"]
