"""SQL storage of admin-set plugin prices (:class:`broker.pricing.service.PriceRepository`)."""
from __future__ import annotations

from sqlalchemy import BigInteger, Float, Integer, String, select
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from broker.pricing.model import PluginPrice
from .base import Base


class PluginPriceRow(Base):
    __tablename__ = "plugin_prices"
    plugin: Mapped[str] = mapped_column(String(64), primary_key=True)
    reserve_micro_per_unit: Mapped[int] = mapped_column(BigInteger)
    fee_bps: Mapped[int] = mapped_column(Integer)
    min_charge_micro: Mapped[int] = mapped_column(BigInteger)
    vesting_window_s: Mapped[int] = mapped_column(Integer)
    cache_price_micro: Mapped[int] = mapped_column(BigInteger, default=100, server_default="100")
    updated_at: Mapped[float] = mapped_column(Float)
    updated_by: Mapped[str] = mapped_column(String(64))


def _price(row: PluginPriceRow) -> PluginPrice:
    return PluginPrice(row.plugin, row.reserve_micro_per_unit, row.fee_bps, row.min_charge_micro,
                       row.vesting_window_s, row.cache_price_micro, updated_at=row.updated_at,
                       updated_by=row.updated_by)


class SqlPriceRepository:
    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def get(self, plugin: str) -> PluginPrice | None:
        with self.sessions() as s:
            row = s.get(PluginPriceRow, plugin)
            return _price(row) if row else None

    def all(self) -> list[PluginPrice]:
        with self.sessions() as s:
            return [_price(r) for r in s.scalars(select(PluginPriceRow).order_by(PluginPriceRow.plugin))]

    def put(self, price: PluginPrice) -> None:
        with self.sessions.begin() as s:
            s.merge(PluginPriceRow(plugin=price.plugin,
                                   reserve_micro_per_unit=price.reserve_micro_per_unit,
                                   fee_bps=price.fee_bps, min_charge_micro=price.min_charge_micro,
                                   vesting_window_s=price.vesting_window_s,
                                   cache_price_micro=price.cache_price_micro,
                                   updated_at=price.updated_at, updated_by=price.updated_by))
