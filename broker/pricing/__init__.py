"""Prices of plugins (admin-set) and the arithmetic of what a job costs (DESIGN §4, §5).

Pure domain: no Flask, grpc or SQLAlchemy. Storage implements :class:`PriceRepository`.
"""
from broker.pricing.model import DEFAULT_PRICES, PluginPrice, Quote
from broker.pricing.service import PricingService

__all__ = ["DEFAULT_PRICES", "PluginPrice", "PricingService", "Quote"]
