"""SQL storage of standing asks and admin-set market rules
(:class:`broker.market.store.AskStore`)."""
from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from .models import MarketRuleRow, StandingAskRow


class SqlAskStore:
    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def load_asks(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        with self.sessions() as s:
            for row in s.scalars(select(StandingAskRow)):
                out.setdefault(row.provider_id, {})[row.plugin] = row.price_micro_per_unit
        return out

    def save_ask(self, provider_id: str, plugin: str, price_micro_per_unit: int,
                 at: float) -> None:
        with self.sessions.begin() as s:
            s.merge(StandingAskRow(provider_id=provider_id, plugin=plugin,
                                   price_micro_per_unit=price_micro_per_unit, updated_at=at))

    def load_rules(self) -> dict[str, float]:
        with self.sessions() as s:
            return {r.name: r.value for r in s.scalars(select(MarketRuleRow))}

    def save_rule(self, name: str, value: float, by: str, at: float) -> None:
        with self.sessions.begin() as s:
            s.merge(MarketRuleRow(name=name, value=value, updated_at=at, updated_by=by))
