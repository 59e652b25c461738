"""What the ledger needs from storage. ``LedgerRepository.unit_of_work()`` opens one atomic
database transaction: everything written through the yielded :class:`LedgerUnitOfWork`
commits together when the ``with`` block ends normally and is discarded when it raises.

Concurrency contract (what the service relies on):

* ``lock_accounts`` and ``get_hold(for_update=True)`` / ``unvested_holds(lock=True)`` lock the
  rows until the unit of work ends and return their latest committed state (PostgreSQL:
  ``SELECT … FOR UPDATE``; SQLite: writers are already serialised by ``BEGIN IMMEDIATE``);
  ``post_hold`` locks the hold it writes and decides on its latest committed state (one
  conditional ``UPDATE``). The service always locks holds before accounts, and accounts in
  sorted order.
* ``add_idempotency`` claims a key: it inserts the record unless one with its key exists
  (committed, or written earlier in the same database transaction) and says which; on
  PostgreSQL a claim of a key another transaction is inserting waits for that one to end.
  The service claims the key before it locks anything else.
* ``add_transaction`` appends the transaction and its entries and moves the accounts' cached
  balances by the entries' amounts in the same database transaction.
* When the database reports a conflict that a retry resolves (a concurrent reversal of the
  same transaction, a serialisation failure, a deadlock), the repository raises
  :class:`RetryableConflict`; the service then retries the whole unit of work.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from datetime import datetime
from typing import Iterable, Protocol, Sequence

from broker.ledger.model import (
    Account, AccountId, HistoryLine, Hold, IdempotencyRecord, Splits, Transaction,
)


class RetryableConflict(Exception):
    """A storage-level conflict; the unit of work was rolled back and may be retried."""


class Clock(Protocol):
    def now(self) -> datetime:
        """The current time, timezone-aware UTC."""


class LedgerUnitOfWork(Protocol):
    # accounts
    def add_accounts(self, accounts: Iterable[AccountId]) -> None:
        """Create the accounts that do not exist yet, at balance zero."""

    def lock_accounts(self, accounts: Sequence[AccountId]) -> dict[AccountId, Account]:
        """Lock and return the accounts that exist (missing ones are absent from the result)."""

    def get_accounts(self, accounts: Sequence[AccountId]) -> dict[AccountId, Account]:
        """Read without locking."""

    def accounts_of(self, owner: str) -> list[Account]: ...

    # transactions
    def add_transaction(self, transaction: Transaction) -> None: ...

    def add_transactions(self, transactions: Sequence[Transaction]) -> None:
        """``add_transaction`` of each, in one write of the transactions, one of their
        entries and one move of each account's balance by the sum of its entries."""

    def get_transaction(self, transaction_id: str) -> Transaction | None: ...

    def reversal_of(self, transaction_id: str) -> Transaction | None:
        """The transaction that reversed ``transaction_id``, if any."""

    def history(self, account: AccountId, *, limit: int) -> list[HistoryLine]:
        """The account's entries, newest first."""

    # holds
    def add_hold(self, hold: Hold) -> None: ...

    def save_hold(self, hold: Hold) -> None:
        """Overwrite a hold's mutable fields (state, resolution, vesting, refund)."""

    def get_hold(self, hold_id: str, *, for_update: bool = False) -> Hold | None: ...

    def post_hold(self, hold_id: str, *, now: datetime, transaction_id: str, splits: Splits,
                  vests_at: datetime) -> Hold | None:
        """Resolve the hold as posted by ``transaction_id`` for ``splits`` (the rest of its
        amount released) if it is pending, ``now`` is before its ``expires_at`` and its
        amount covers the splits, locking it; return it as saved. Otherwise write nothing
        and return None."""

    def post_holds(self, posts: Sequence[tuple[str, str, Splits, datetime]], *,
                   now: datetime) -> list[Hold | None]:
        """``post_hold`` of each ``(hold_id, transaction_id, splits, vests_at)``, in order:
        the holds as saved, None for each that was not postable (nothing written for it)."""

    def due_hold_ids(self, now: datetime, *, limit: int) -> list[str]:
        """Ids of pending holds whose ``expires_at`` ≤ ``now``, oldest first."""

    def unvested_holds(self, provider: str, *, due_by: datetime | None = None,
                       lock: bool = False) -> list[Hold]:
        """Posted, unrefunded, unvested holds of ``provider`` with a provider share (only
        those whose ``vests_at`` ≤ ``due_by``, when given), ordered by id; with ``lock``,
        locked."""

    # idempotency
    def get_idempotency(self, key: str) -> IdempotencyRecord | None: ...

    def add_idempotency(self, record: IdempotencyRecord) -> bool:
        """Insert ``record``; False, writing nothing, when its key already has one."""

    def add_idempotencies(self, records: Sequence[IdempotencyRecord]) -> int:
        """``add_idempotency`` of each (keys distinct): how many were inserted."""

    # audit
    def audit(self) -> tuple[int, int, list[str]]:
        """(sum of all entries, number of transactions, problems): a problem is a transaction
        whose entries do not sum to zero, or an account whose cached balance differs from
        the sum of its entries or is below zero where its kind forbids it."""


class LedgerRepository(Protocol):
    def unit_of_work(self) -> AbstractContextManager[LedgerUnitOfWork]: ...
