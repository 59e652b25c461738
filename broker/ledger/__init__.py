"""The double-entry credit ledger (DESIGN §5): accounts, append-only transactions whose
entries sum to zero, two-phase holds, vesting and payouts, in integer micro-credits.

Pure domain: this package imports no Flask, grpc or SQLAlchemy. Storage implements
:class:`broker.ledger.ports.LedgerRepository`; transports call :class:`LedgerService`.
"""
from broker.ledger.model import (
    MICRO_PER_CREDIT, AccountId, AccountKind, Entry, FundingSource, Hold, HoldState, Splits,
    Transaction, TransactionKind, format_credits,
)
from broker.ledger.service import LedgerService

__all__ = [
    "MICRO_PER_CREDIT", "AccountId", "AccountKind", "Entry", "FundingSource", "Hold", "HoldState",
    "LedgerService", "Splits", "Transaction", "TransactionKind", "format_credits",
]
