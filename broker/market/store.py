"""Where standing asks and the admin's market rules outlive the broker process.

The order book itself lives in memory (it is rebuilt from live connections); what must
survive a restart, or an agent reconnecting without re-posting, is each provider's last
valid ask per plugin and the rules an admin set (the reputation floor). The market writes
through on every accepted ask and reads everything back once at start.
"""
from __future__ import annotations

from typing import Protocol


class AskStore(Protocol):
    def load_asks(self) -> dict[str, dict[str, int]]:
        """Every stored ask: provider id -> plugin -> micro-credits per work unit."""
        ...

    def save_ask(self, provider_id: str, plugin: str, price_micro_per_unit: int,
                 at: float) -> None:
        """Insert or replace the provider's ask for the plugin."""
        ...

    def load_rules(self) -> dict[str, float]:
        """Admin-set market rules by name (e.g. ``reputation_floor``)."""
        ...

    def save_rule(self, name: str, value: float, by: str, at: float) -> None:
        ...


class InMemoryAskStore:
    """The store for tests and for a broker run without a database."""

    def __init__(self) -> None:
        self.asks: dict[str, dict[str, int]] = {}
        self.rules: dict[str, float] = {}

    def load_asks(self) -> dict[str, dict[str, int]]:
        return {pid: dict(asks) for pid, asks in self.asks.items()}

    def save_ask(self, provider_id: str, plugin: str, price_micro_per_unit: int,
                 at: float) -> None:
        self.asks.setdefault(provider_id, {})[plugin] = price_micro_per_unit

    def load_rules(self) -> dict[str, float]:
        return dict(self.rules)

    def save_rule(self, name: str, value: float, by: str, at: float) -> None:
        self.rules[name] = value
