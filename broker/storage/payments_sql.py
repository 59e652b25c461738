"""SQL storage of payments: providers' Stripe Connect accounts and payouts."""
from __future__ import annotations

from sqlalchemy import BigInteger, Float, Index, String, Text, func, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from broker.payments.model import Payout
from .base import Base


class ConnectAccountRow(Base):
    __tablename__ = "connect_accounts"
    owner_id: Mapped[str] = mapped_column(String(160), primary_key=True)  # provider account id
    stripe_account_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)


class PayoutRow(Base):
    __tablename__ = "payouts"
    __table_args__ = (Index("ix_payouts_owner_id_created_at", "owner_id", "created_at"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # the ledger payout txn id
    owner_id: Mapped[str] = mapped_column(String(160))
    amount_micro: Mapped[int] = mapped_column(BigInteger)
    amount_cents: Mapped[int] = mapped_column(BigInteger)
    currency: Mapped[str] = mapped_column(String(8))
    destination: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))  # pending | paid | failed
    transfer_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    reversal_transaction_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)


def _payout(r: PayoutRow) -> Payout:
    return Payout(id=r.id, owner_id=r.owner_id, amount_micro=r.amount_micro,
                  amount_cents=r.amount_cents, currency=r.currency, destination=r.destination,
                  status=r.status, transfer_id=r.transfer_id,
                  reversal_transaction_id=r.reversal_transaction_id, error=r.error,
                  created_at=r.created_at)


class SqlPaymentsRepository:
    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def connect_account(self, owner_id: str) -> str | None:
        with self.sessions() as s:
            row = s.get(ConnectAccountRow, owner_id)
            return row.stripe_account_id if row else None

    def set_connect_account(self, owner_id: str, stripe_account_id: str, now: float) -> None:
        with self.sessions.begin() as s:
            s.merge(ConnectAccountRow(owner_id=owner_id, stripe_account_id=stripe_account_id,
                                      created_at=now))

    def add_payout(self, p: Payout) -> None:
        with self.sessions.begin() as s:
            if s.get(PayoutRow, p.id) is None:
                s.add(PayoutRow(id=p.id, owner_id=p.owner_id, amount_micro=p.amount_micro,
                                amount_cents=p.amount_cents, currency=p.currency,
                                destination=p.destination, status=p.status,
                                transfer_id=p.transfer_id, error=p.error, created_at=p.created_at))

    def get_payout(self, payout_id: str) -> Payout | None:
        with self.sessions() as s:
            row = s.get(PayoutRow, payout_id)
            return _payout(row) if row else None

    def payout_by_transfer(self, transfer_id: str) -> Payout | None:
        with self.sessions() as s:
            row = s.scalars(select(PayoutRow).where(PayoutRow.transfer_id == transfer_id)).first()
            return _payout(row) if row else None

    def update_payout(self, payout_id: str, **fields) -> None:
        with self.sessions.begin() as s:
            s.execute(update(PayoutRow).where(PayoutRow.id == payout_id).values(**fields))

    def paid_out_micro(self, owner_id: str) -> int:
        with self.sessions() as s:
            return int(s.scalar(select(func.coalesce(func.sum(PayoutRow.amount_micro), 0))
                                .where(PayoutRow.owner_id == owner_id,
                                       PayoutRow.status == "paid")))

    def payouts_of(self, owner_id: str, limit: int = 100) -> list[Payout]:
        with self.sessions() as s:
            rows = s.scalars(select(PayoutRow).where(PayoutRow.owner_id == owner_id)
                             .order_by(PayoutRow.created_at.desc()).limit(limit))
            return [_payout(r) for r in rows]
