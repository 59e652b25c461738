"""An in-memory :class:`LedgerRepository` for unit tests and as a speed baseline, and a
:class:`FakeClock`.

One lock serialises units of work (like SQLite's ``BEGIN IMMEDIATE``). Writes go to an
overlay that is merged on commit and dropped when the unit of work raises, so a refused
operation leaves no trace — the same atomicity the SQL repository gets from the database.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Iterable, Iterator, Sequence

from broker.ledger.model import (
    Account, AccountId, HistoryLine, Hold, HoldState, IdempotencyRecord, Splits, Transaction,
)


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self, start: datetime | None = None):
        self._now = start or datetime(2026, 1, 1, tzinfo=timezone.utc)

    def now(self) -> datetime:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += timedelta(seconds=seconds)


class _State:
    def __init__(self) -> None:
        self.accounts: dict[AccountId, Account] = {}
        self.transactions: dict[str, Transaction] = {}
        self.order: list[str] = []  # transaction ids in commit order
        self.reversals: dict[str, str] = {}
        self.holds: dict[str, Hold] = {}
        self.idempotency: dict[str, IdempotencyRecord] = {}


class InMemoryLedgerRepository:
    """Keeps the ledger in dicts; thread-safe, one unit of work at a time."""

    def __init__(self) -> None:
        self._state = _State()
        self._lock = threading.Lock()

    @contextmanager
    def unit_of_work(self) -> Iterator["_MemoryUnitOfWork"]:
        with self._lock:
            uow = _MemoryUnitOfWork(self._state)
            yield uow
            uow.commit()


class _MemoryUnitOfWork:
    def __init__(self, state: _State):
        self._s = state
        self._accounts: dict[AccountId, Account] = {}
        self._transactions: list[Transaction] = []
        self._holds: dict[str, Hold] = {}
        self._idempotency: dict[str, IdempotencyRecord] = {}

    def commit(self) -> None:
        s = self._s
        s.accounts.update(self._accounts)
        for txn in self._transactions:
            s.transactions[txn.id] = txn
            s.order.append(txn.id)
            if txn.reverses_id:
                s.reversals[txn.reverses_id] = txn.id
        s.holds.update(self._holds)
        s.idempotency.update(self._idempotency)

    # accounts
    def _account(self, account_id: AccountId) -> Account | None:
        return self._accounts.get(account_id) or self._s.accounts.get(account_id)

    def add_accounts(self, accounts: Iterable[AccountId]) -> None:
        for account_id in accounts:
            if self._account(account_id) is None:
                self._accounts[account_id] = Account(account_id, 0)

    def get_accounts(self, accounts: Sequence[AccountId]) -> dict[AccountId, Account]:
        return {a: acc for a in accounts if (acc := self._account(a)) is not None}

    lock_accounts = get_accounts  # the repository lock already serialises writers

    def accounts_of(self, owner: str) -> list[Account]:
        ids = {a for a in (*self._s.accounts, *self._accounts) if a.owner == owner}
        return [self._account(a) for a in sorted(ids)]  # type: ignore[misc]

    # transactions
    def add_transaction(self, transaction: Transaction) -> None:
        for entry in transaction.entries:
            account = self._account(entry.account)
            assert account is not None, f"entry on unknown account {entry.account}"
            self._accounts[entry.account] = replace(
                account, balance_micro=account.balance_micro + entry.amount_micro)
        self._transactions.append(transaction)

    def add_transactions(self, transactions) -> None:
        for transaction in transactions:
            self.add_transaction(transaction)

    def get_transaction(self, transaction_id: str) -> Transaction | None:
        found = self._s.transactions.get(transaction_id)
        return found or next((t for t in self._transactions if t.id == transaction_id), None)

    def reversal_of(self, transaction_id: str) -> Transaction | None:
        rid = self._s.reversals.get(transaction_id)
        if rid is not None:
            return self._s.transactions[rid]
        return next((t for t in self._transactions if t.reverses_id == transaction_id), None)

    def history(self, account: AccountId, *, limit: int) -> list[HistoryLine]:
        lines = []
        for tid in reversed(self._s.order):
            txn = self._s.transactions[tid]
            for entry in reversed(txn.entries):
                if entry.account == account:
                    lines.append(HistoryLine(txn.id, txn.kind, txn.created_at, entry.amount_micro,
                                             txn.memo, txn.hold_id))
            if len(lines) >= limit:
                break
        return lines[:limit]

    # holds
    def add_hold(self, hold: Hold) -> None:
        self._holds[hold.id] = hold

    save_hold = add_hold

    def get_hold(self, hold_id: str, *, for_update: bool = False) -> Hold | None:
        return self._holds.get(hold_id) or self._s.holds.get(hold_id)

    def post_hold(self, hold_id: str, *, now: datetime, transaction_id: str, splits: Splits,
                  vests_at: datetime) -> Hold | None:
        hold = self.get_hold(hold_id)
        if (hold is None or hold.state is not HoldState.PENDING or now >= hold.expires_at
                or splits.captured_micro > hold.amount_micro):
            return None
        posted = replace(
            hold, state=HoldState.POSTED, resolved_at=now, resolve_transaction_id=transaction_id,
            captured_micro=splits.captured_micro,
            released_micro=hold.amount_micro - splits.captured_micro,
            provider=splits.provider, provider_micro=splits.provider_micro,
            publisher=splits.publisher, royalty_micro=splits.royalty_micro,
            other_royalties=splits.other_royalties, fee_micro=splits.fee_micro,
            vests_at=vests_at)
        self._holds[hold_id] = posted
        return posted

    def post_holds(self, posts, *, now: datetime) -> list[Hold | None]:
        return [self.post_hold(hold_id, now=now, transaction_id=txn_id, splits=splits,
                               vests_at=vests_at) for hold_id, txn_id, splits, vests_at in posts]

    def due_hold_ids(self, now: datetime, *, limit: int) -> list[str]:
        due = sorted((h.expires_at, h.id) for h in self._s.holds.values()
                     if h.state is HoldState.PENDING and h.expires_at <= now)
        return [hid for _, hid in due[:limit]]

    def unvested_holds(self, provider: str, *, due_by: datetime | None = None,
                       lock: bool = False) -> list[Hold]:
        # (``lock``: a unit of work here already has the store to itself)
        return sorted((h for h in self._s.holds.values()
                       if h.state is HoldState.POSTED and h.provider == provider
                       and h.provider_micro > 0
                       and (due_by is None or (h.vests_at is not None and h.vests_at <= due_by))
                       and h.vest_transaction_id is None and h.refund_transaction_id is None),
                      key=lambda h: h.id)

    # idempotency
    def get_idempotency(self, key: str) -> IdempotencyRecord | None:
        return self._idempotency.get(key) or self._s.idempotency.get(key)

    def add_idempotency(self, record: IdempotencyRecord) -> bool:
        if self.get_idempotency(record.key) is not None:
            return False
        self._idempotency[record.key] = record
        return True

    def add_idempotencies(self, records) -> int:
        return sum(self.add_idempotency(r) for r in records)

    # audit
    def audit(self) -> tuple[int, int, list[str]]:
        sums: dict[AccountId, int] = {a: 0 for a in self._s.accounts}
        total, problems = 0, []
        for txn in self._s.transactions.values():
            txn_total = sum(e.amount_micro for e in txn.entries)
            if txn_total:
                problems.append(f"transaction {txn.id} sums to {txn_total}")
            total += txn_total
            for e in txn.entries:
                sums[e.account] = sums.get(e.account, 0) + e.amount_micro
        for account_id, computed in sums.items():
            account = self._s.accounts.get(account_id)
            cached = account.balance_micro if account else None
            if cached != computed:
                problems.append(f"{account_id}: cached balance {cached}, entries sum {computed}")
            if computed < 0 and not account_id.kind.allows_negative:
                problems.append(f"{account_id} is negative ({computed}) but its kind forbids it")
        return total, len(self._s.transactions), problems
