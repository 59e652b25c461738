"""SQL storage of operator links (``broker.links``): one row per account and signal."""
from __future__ import annotations

from sqlalchemy import Float, Index, String, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, mapped_column, sessionmaker

from broker.links.service import LinkKind, Signal
from .base import Base


class OperatorSignalRow(Base):
    __tablename__ = "operator_signals"
    __table_args__ = (Index("ix_operator_signals_value", "kind", "value_sha256"),)
    account_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), primary_key=True)
    value_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    label: Mapped[str] = mapped_column(String(200))
    first_seen_at: Mapped[float] = mapped_column(Float)
    last_seen_at: Mapped[float] = mapped_column(Float)


class SqlLinkRepository:
    def __init__(self, sessions: sessionmaker):
        self.sessions = sessions

    def record(self, account_id: str, kind: str, value_sha256: str, label: str,
               now: float) -> bool:
        key = {"account_id": account_id, "kind": kind, "value_sha256": value_sha256}
        with self.sessions.begin() as s:
            if s.execute(update(OperatorSignalRow).filter_by(**key)
                         .values(last_seen_at=now)).rowcount:
                return False
        try:
            with self.sessions.begin() as s:
                s.add(OperatorSignalRow(**key, label=label[:200], first_seen_at=now,
                                        last_seen_at=now))
            return True
        except IntegrityError:  # another replica recorded it meanwhile
            return False

    def signals_of(self, account_id: str) -> list[Signal]:
        with self.sessions() as s:
            rows = s.scalars(select(OperatorSignalRow)
                             .where(OperatorSignalRow.account_id == account_id))
            return [Signal(r.account_id, LinkKind(r.kind), r.value_sha256, r.label,
                           r.first_seen_at, r.last_seen_at) for r in rows]

    def sharing(self, kind: str, value_sha256: str) -> list[str]:
        with self.sessions() as s:
            return list(s.scalars(select(OperatorSignalRow.account_id).where(
                OperatorSignalRow.kind == kind,
                OperatorSignalRow.value_sha256 == value_sha256).limit(1000)))
