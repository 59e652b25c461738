"""The ledger's SQL storage: tables and :class:`SqlLedgerRepository` (SQLite and PostgreSQL).

Balances are a cached ``balance_micro`` column on ``ledger_accounts``, moved in the same
database transaction that appends the entries, after the service locked the rows with
``SELECT … FOR UPDATE`` (PostgreSQL; SQLite's ``BEGIN IMMEDIATE`` already serialises
writers). Why cached rather than summed from entries: the overdraft check of every hold
reads the balance, and summing an ever-growing entry table would make it O(history); and
the account row is the natural thing to lock — with computed balances there is no row to
lock and preventing concurrent overdrafts would need SERIALIZABLE isolation and retries.
A CHECK constraint (``allow_negative OR balance_micro >= 0``) backs the service's own check,
and :meth:`audit` recomputes every balance from the entries.

Entries are append-only: this module never issues UPDATE or DELETE on ``ledger_entries`` or
``ledger_transactions``. Queries use SQLAlchemy Core on the mapped tables (no ORM identity
map to go stale between units of work, and fewer round trips).
"""
from __future__ import annotations

from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Iterable, Iterator, Sequence

from sqlalchemy import (
    BigInteger, Boolean, CheckConstraint, DateTime, ForeignKey, Index, Integer, JSON, String, Text,
    bindparam, case, func, insert, select, update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Mapped, mapped_column

from broker.ledger.model import (
    Account, AccountId, AccountKind, Entry, HistoryLine, Hold, HoldState, IdempotencyRecord,
    Splits, Transaction, TransactionKind,
)
from broker.ledger.ports import RetryableConflict
from broker.storage.base import Base, begin
from broker.storage.fast import Prepared, insert_rows

# BIGINT everywhere for money; SQLite only auto-numbers an INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer, "sqlite")
UTC_DATETIME = DateTime(timezone=True)


class LedgerAccountRow(Base):
    __tablename__ = "ledger_accounts"
    __table_args__ = (
        CheckConstraint("allow_negative OR balance_micro >= 0", name="non_negative"),
        Index("ix_ledger_accounts_owner_id", "owner_id"),
    )
    id: Mapped[str] = mapped_column(String(200), primary_key=True)  # "kind:owner"
    kind: Mapped[str] = mapped_column(String(40))
    owner_id: Mapped[str] = mapped_column(String(160))
    allow_negative: Mapped[bool] = mapped_column(Boolean)
    balance_micro: Mapped[int] = mapped_column(BigInteger)


class LedgerTransactionRow(Base):
    __tablename__ = "ledger_transactions"
    __table_args__ = (Index("ix_ledger_transactions_hold_id", "hold_id"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    kind: Mapped[str] = mapped_column(String(20))
    created_at: Mapped[datetime] = mapped_column(UTC_DATETIME)
    memo: Mapped[str] = mapped_column(Text)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True)
    hold_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # Unique: a transaction is reversed at most once, even under concurrency.
    reverses_id: Mapped[str | None] = mapped_column(
        String(32), ForeignKey("ledger_transactions.id"), nullable=True, unique=True)


class LedgerEntryRow(Base):
    __tablename__ = "ledger_entries"
    __table_args__ = (
        CheckConstraint("amount_micro <> 0", name="nonzero"),
        Index("ix_ledger_entries_account_id_id", "account_id", "id"),
        Index("ix_ledger_entries_transaction_id", "transaction_id"),
    )
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    transaction_id: Mapped[str] = mapped_column(String(32), ForeignKey("ledger_transactions.id"))
    account_id: Mapped[str] = mapped_column(String(200), ForeignKey("ledger_accounts.id"))
    amount_micro: Mapped[int] = mapped_column(BigInteger)


class LedgerHoldRow(Base):
    __tablename__ = "ledger_holds"
    __table_args__ = (
        CheckConstraint("amount_micro > 0", name="positive"),
        CheckConstraint("captured_micro + released_micro <= amount_micro", name="conserved"),
        Index("ix_ledger_holds_state_expires_at", "state", "expires_at"),
        Index("ix_ledger_holds_provider_id_vests_at", "provider_id", "vests_at"),
        Index("ix_ledger_holds_job_id", "job_id"),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    client_id: Mapped[str] = mapped_column(String(160))
    job_id: Mapped[str] = mapped_column(String(160))
    amount_micro: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(10))
    created_at: Mapped[datetime] = mapped_column(UTC_DATETIME)
    expires_at: Mapped[datetime] = mapped_column(UTC_DATETIME)
    hold_transaction_id: Mapped[str] = mapped_column(String(32))
    resolved_at: Mapped[datetime | None] = mapped_column(UTC_DATETIME, nullable=True)
    resolve_transaction_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    captured_micro: Mapped[int] = mapped_column(BigInteger)
    released_micro: Mapped[int] = mapped_column(BigInteger)
    provider_id: Mapped[str | None] = mapped_column(String(160), nullable=True)
    provider_micro: Mapped[int] = mapped_column(BigInteger)
    publisher_id: Mapped[str | None] = mapped_column(String(160), nullable=True)
    royalty_micro: Mapped[int] = mapped_column(BigInteger)
    fee_micro: Mapped[int] = mapped_column(BigInteger)
    vests_at: Mapped[datetime | None] = mapped_column(UTC_DATETIME, nullable=True)
    vest_transaction_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    refund_transaction_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # [[publisher, micro], ...] beyond publisher_id's (a job using several publishers'
    # adapters); NULL when there are none (migration 0013).
    other_royalties: Mapped[list | None] = mapped_column(JSON, nullable=True)


class LedgerIdempotencyRow(Base):
    """What an idempotency key produced; inserted in the same transaction as the effect
    (so a Stripe event id used as the key is deduplicated atomically)."""

    __tablename__ = "ledger_idempotency"
    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    operation: Mapped[str] = mapped_column(String(30))
    fingerprint: Mapped[str] = mapped_column(String(64))
    result_type: Mapped[str] = mapped_column(String(12))
    result_id: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(UTC_DATETIME)


accounts_t = LedgerAccountRow.__table__
transactions_t = LedgerTransactionRow.__table__
entries_t = LedgerEntryRow.__table__
holds_t = LedgerHoldRow.__table__
idempotency_t = LedgerIdempotencyRow.__table__

#: The ledger's tables, in creation order (for ``Base.metadata.create_all(tables=…)``).
LEDGER_TABLES = (accounts_t, transactions_t, entries_t, holds_t, idempotency_t)

# Statements are built once and executed with parameter dicts (see broker/storage/jobs_sql.py:
# building a construct per call cost more than running it). Where-clause parameters are
# named ``w_*`` so that they never collide with a column an UPDATE sets.
_ACCOUNTS = Prepared(select(accounts_t.c.id, accounts_t.c.balance_micro)
                     .where(accounts_t.c.id.in_(bindparam("w_ids", expanding=True)))
                     .order_by(accounts_t.c.id))
_ACCOUNTS_FOR_UPDATE = Prepared(_ACCOUNTS.stmt.with_for_update())
_ACCOUNT_IDS = Prepared(select(accounts_t.c.id)
                        .where(accounts_t.c.id.in_(bindparam("w_ids", expanding=True))))
_ACCOUNTS_OF = Prepared(select(accounts_t.c.id, accounts_t.c.balance_micro)
                        .where(accounts_t.c.owner_id == bindparam("w_owner"))
                        .order_by(accounts_t.c.id))
_INSERT_ACCOUNT = Prepared(insert(accounts_t))
_INSERT_TRANSACTION = Prepared(insert(transactions_t))
_INSERT_ENTRIES = Prepared(insert(entries_t))  # executemany (SQLite: see add_transaction)
_INSERT_HOLD = Prepared(insert(holds_t))
_UPDATE_HOLD = Prepared(update(holds_t).where(holds_t.c.id == bindparam("w_id")))
_HOLD = Prepared(select(holds_t).where(holds_t.c.id == bindparam("w_id")))
_HOLD_FOR_UPDATE = Prepared(_HOLD.stmt.with_for_update())


def _post_hold_statement(returning: bool) -> Prepared:
    """A post of a hold: ``UPDATE … WHERE id = :w_id AND state = 'pending' AND expires_at >
    :w_now AND amount_micro >= :w_captured``, ``released_micro`` the rest of the amount, the
    other columns SET from the parameters; with RETURNING of the row where the database has
    it (SQLite >= 3.35, PostgreSQL), in place of a SELECT … FOR UPDATE before the write and
    a SELECT after it. On PostgreSQL a hold another transaction is resolving is waited for
    and then found resolved; expires_at and amount never change."""
    captured = bindparam("w_captured", type_=BigInteger)
    stmt = (update(holds_t)
            .where(holds_t.c.id == bindparam("w_id"), holds_t.c.state == HoldState.PENDING.value,
                   holds_t.c.expires_at > bindparam("w_now", type_=UTC_DATETIME),
                   holds_t.c.amount_micro >= captured)
            .values(released_micro=holds_t.c.amount_micro - captured))
    return Prepared(stmt.returning(*holds_t.c) if returning else stmt)


_POST_HOLD = {returning: _post_hold_statement(returning) for returning in (False, True)}
_IDEMPOTENCY = Prepared(select(idempotency_t).where(idempotency_t.c.key == bindparam("w_key")))
# A claim of a key: inserts nothing (and raises nothing) when the key has a record.
_CLAIM_IDEMPOTENCY = {
    "sqlite": Prepared(sqlite_insert(idempotency_t)
                       .on_conflict_do_nothing(index_elements=[idempotency_t.c.key])),
    "postgresql": Prepared(pg_insert(idempotency_t)
                           .on_conflict_do_nothing(index_elements=[idempotency_t.c.key]))}
_ENTRIES_OF = Prepared(select(entries_t.c.transaction_id, entries_t.c.account_id,
                              entries_t.c.amount_micro)
                       .where(entries_t.c.transaction_id.in_(bindparam("w_ids", expanding=True)))
                       .order_by(entries_t.c.id))
_TRANSACTION_BY_ID = Prepared(select(transactions_t)
                              .where(transactions_t.c.id == bindparam("w_id")))
_REVERSAL_OF = Prepared(select(transactions_t)
                        .where(transactions_t.c.reverses_id == bindparam("w_id")))
_BALANCE_UPDATES: dict[int, Prepared] = {}
_ENTRY_INSERTS: dict[int, Prepared] = {}


def _balance_update(legs: int) -> Prepared:
    """One UPDATE that moves every leg's balance (a round trip per leg was a third of a
    post's time): ``SET balance_micro = balance_micro + CASE id WHEN :w_a0 THEN :w_d0 …``,
    built once per number of legs."""
    stmt = _BALANCE_UPDATES.get(legs)
    if stmt is None:
        ids = [bindparam(f"w_a{i}") for i in range(legs)]
        delta = case(*[(accounts_t.c.id == ids[i], bindparam(f"w_d{i}", type_=BigInteger))
                       for i in range(legs)])
        stmt = _BALANCE_UPDATES.setdefault(legs, Prepared(
            update(accounts_t).where(accounts_t.c.id.in_(ids))
            .values(balance_micro=accounts_t.c.balance_micro + delta)))
    return stmt


def _entries_insert(legs: int) -> Prepared:
    """One INSERT of a transaction's entries, ``VALUES (:w_txn, :w_a0, :w_d0), …``, built
    once per number of legs, with the parameters of :func:`_balance_update` (PostgreSQL:
    see add_transaction)."""
    stmt = _ENTRY_INSERTS.get(legs)
    if stmt is None:
        txn = bindparam("w_txn")
        stmt = _ENTRY_INSERTS.setdefault(legs, Prepared(insert(entries_t).values([
            {"transaction_id": txn, "account_id": bindparam(f"w_a{i}"),
             "amount_micro": bindparam(f"w_d{i}", type_=BigInteger)} for i in range(legs)])))
    return stmt


def _stored_royalties(others: tuple[tuple[str, int], ...]) -> list | None:
    return [[p, m] for p, m in others] or None


def create_ledger_tables(engine: Engine) -> None:
    """Create the ledger's tables (tests and the bench; deployments run the migrations)."""
    Base.metadata.create_all(engine, tables=list(LEDGER_TABLES))


def _utc(value: datetime | None) -> datetime | None:
    # SQLite keeps no offset: values were written as UTC, so read them back as UTC.
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


_RETRYABLE_SQLSTATES = {"40001", "40P01"}  # serialization_failure, deadlock_detected


class SqlLedgerRepository:
    """The ledger on SQLAlchemy 2 Core; an engine from :func:`broker.storage.base.make_engine`."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock_rows = engine.dialect.name != "sqlite"  # SQLite has no FOR UPDATE

    @contextmanager
    def unit_of_work(self) -> Iterator["_SqlUnitOfWork"]:
        try:
            with begin(self.engine) as conn:
                yield _SqlUnitOfWork(conn, self._lock_rows)
        except IntegrityError as exc:
            # Two writers reversed the same transaction at once: the loser retries and then
            # finds the winner's reversal. (Idempotency keys are claimed without an error:
            # see add_idempotency.)
            if _is_unique_violation(exc):
                raise RetryableConflict(str(exc.orig)) from exc
            raise
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) in _RETRYABLE_SQLSTATES:
                raise RetryableConflict(str(exc.orig)) from exc
            raise


def _is_unique_violation(exc: IntegrityError) -> bool:
    sqlstate = getattr(exc.orig, "sqlstate", None)
    return sqlstate == "23505" or "UNIQUE constraint failed" in str(exc.orig)


class _SqlUnitOfWork:
    def __init__(self, conn: Connection, lock_rows: bool):
        self.c = conn
        self._lock_rows = lock_rows
        # Read from the connected dialect (SQLite's RETURNING depends on its version).
        self._returning = bool(conn.dialect.update_returning)  # see _post_hold_statement
        self._multi_row = conn.dialect.name != "sqlite"  # see add_transaction

    # accounts
    def add_accounts(self, accounts: Iterable[AccountId]) -> None:
        wanted = {str(a): a for a in accounts}
        existing = {r[0] for r in _ACCOUNT_IDS.run(self.c, {"w_ids": list(wanted)})}
        rows = [{"id": key, "kind": a.kind.value, "owner_id": a.owner,
                 "allow_negative": a.kind.allows_negative, "balance_micro": 0}
                for key, a in wanted.items() if key not in existing]
        if rows:
            _INSERT_ACCOUNT.run(self.c, rows)

    def _select_accounts(self, accounts: Sequence[AccountId], lock: bool) -> dict[AccountId, Account]:
        by_key = {str(a): a for a in accounts}
        query = _ACCOUNTS_FOR_UPDATE if lock and self._lock_rows else _ACCOUNTS
        found = {}
        for key, balance in query.run(self.c, {"w_ids": sorted(by_key)}):
            account = by_key[key] if key in by_key else AccountId.parse(key)
            found[account] = Account(account, balance)
        return found

    def lock_accounts(self, accounts: Sequence[AccountId]) -> dict[AccountId, Account]:
        return self._select_accounts(accounts, lock=True)

    def get_accounts(self, accounts: Sequence[AccountId]) -> dict[AccountId, Account]:
        return self._select_accounts(accounts, lock=False)

    def accounts_of(self, owner: str) -> list[Account]:
        rows = _ACCOUNTS_OF.run(self.c, {"w_owner": owner})
        return [Account(AccountId.parse(key), balance) for key, balance in rows]

    # transactions
    def add_transaction(self, transaction: Transaction) -> None:
        t = transaction
        _INSERT_TRANSACTION.run(self.c, {
            "id": t.id, "kind": t.kind.value, "created_at": t.created_at, "memo": t.memo,
            "idempotency_key": t.idempotency_key, "hold_id": t.hold_id,
            "reverses_id": t.reverses_id})
        params = {"w_txn": t.id}
        for i, e in enumerate(t.entries):
            params[f"w_a{i}"] = str(e.account)
            params[f"w_d{i}"] = e.amount_micro
        # The entries: psycopg runs an executemany as a pipeline of one statement per row,
        # about twice the client CPU of one multi-row INSERT; SQLite steps its one prepared
        # statement per row faster than it runs a multi-row INSERT.
        if self._multi_row:
            _entries_insert(len(t.entries)).run(self.c, params)
        else:
            _INSERT_ENTRIES.run(self.c, [
                {"transaction_id": t.id, "account_id": params[f"w_a{i}"],
                 "amount_micro": e.amount_micro} for i, e in enumerate(t.entries)])
        _balance_update(len(t.entries)).run(self.c, params)

    def add_transactions(self, transactions: Sequence[Transaction]) -> None:
        """The transactions, then all their entries, then each account's balance moved
        once by the sum of its entries: three statements however many there are
        (PostgreSQL multi-row INSERTs; SQLite steps one prepared INSERT per row, as in
        add_transaction)."""
        if not transactions:
            return
        txns = [{"id": t.id, "kind": t.kind.value, "created_at": t.created_at, "memo": t.memo,
                 "idempotency_key": t.idempotency_key, "hold_id": t.hold_id,
                 "reverses_id": t.reverses_id} for t in transactions]
        entries = [{"transaction_id": t.id, "account_id": str(e.account),
                    "amount_micro": e.amount_micro} for t in transactions for e in t.entries]
        if self._multi_row:
            insert_rows(self.c, transactions_t, txns)
            insert_rows(self.c, entries_t, entries)
        else:
            _INSERT_TRANSACTION.run(self.c, txns)
            _INSERT_ENTRIES.run(self.c, entries)
        net: dict[str, int] = {}
        for e in entries:
            net[e["account_id"]] = net.get(e["account_id"], 0) + e["amount_micro"]
        moved = sorted(a for a, d in net.items() if d)
        if moved:
            params = {}
            for i, account in enumerate(moved):
                params[f"w_a{i}"], params[f"w_d{i}"] = account, net[account]
            _balance_update(len(moved)).run(self.c, params)

    def _load_transactions(self, query, transaction_id: str) -> list[Transaction]:
        rows = query.run(self.c, {"w_id": transaction_id}).mappings()
        if not rows:
            return []
        entries: dict[str, list[Entry]] = {r["id"]: [] for r in rows}
        for tid, account, amount in _ENTRIES_OF.run(self.c, {"w_ids": list(entries)}):
            entries[tid].append(Entry(AccountId.parse(account), amount))
        return [Transaction(id=r["id"], kind=TransactionKind(r["kind"]),
                            created_at=_utc(r["created_at"]), entries=tuple(entries[r["id"]]),
                            memo=r["memo"], idempotency_key=r["idempotency_key"],
                            hold_id=r["hold_id"], reverses_id=r["reverses_id"]) for r in rows]

    def get_transaction(self, transaction_id: str) -> Transaction | None:
        found = self._load_transactions(_TRANSACTION_BY_ID, transaction_id)
        return found[0] if found else None

    def reversal_of(self, transaction_id: str) -> Transaction | None:
        found = self._load_transactions(_REVERSAL_OF, transaction_id)
        return found[0] if found else None

    def history(self, account: AccountId, *, limit: int) -> list[HistoryLine]:
        rows = self.c.execute(
            select(entries_t.c.transaction_id, transactions_t.c.kind, transactions_t.c.created_at,
                   entries_t.c.amount_micro, transactions_t.c.memo, transactions_t.c.hold_id)
            .join(transactions_t, transactions_t.c.id == entries_t.c.transaction_id)
            .where(entries_t.c.account_id == str(account))
            .order_by(entries_t.c.id.desc()).limit(limit))
        return [HistoryLine(tid, TransactionKind(kind), _utc(at), amount, memo, hold_id)
                for tid, kind, at, amount, memo, hold_id in rows]

    # holds
    @staticmethod
    def _hold_changes(h: Hold) -> dict:
        """The columns that may change after ``add_hold`` (what ``save_hold`` writes)."""
        return {"state": h.state.value, "resolved_at": h.resolved_at,
                "resolve_transaction_id": h.resolve_transaction_id,
                "captured_micro": h.captured_micro, "released_micro": h.released_micro,
                "provider_id": h.provider, "provider_micro": h.provider_micro,
                "publisher_id": h.publisher, "royalty_micro": h.royalty_micro,
                "fee_micro": h.fee_micro, "vests_at": h.vests_at,
                "vest_transaction_id": h.vest_transaction_id,
                "refund_transaction_id": h.refund_transaction_id,
                "other_royalties": _stored_royalties(h.other_royalties)}

    @classmethod
    def _hold_values(cls, h: Hold) -> dict:
        return {"id": h.id, "client_id": h.client, "job_id": h.job_id,
                "amount_micro": h.amount_micro, "created_at": h.created_at,
                "expires_at": h.expires_at, "hold_transaction_id": h.hold_transaction_id,
                **cls._hold_changes(h)}

    @staticmethod
    def _hold(r) -> Hold:
        return Hold(id=r["id"], client=r["client_id"], job_id=r["job_id"],
                    amount_micro=r["amount_micro"], state=HoldState(r["state"]),
                    created_at=_utc(r["created_at"]), expires_at=_utc(r["expires_at"]),
                    hold_transaction_id=r["hold_transaction_id"], resolved_at=_utc(r["resolved_at"]),
                    resolve_transaction_id=r["resolve_transaction_id"],
                    captured_micro=r["captured_micro"], released_micro=r["released_micro"],
                    provider=r["provider_id"], provider_micro=r["provider_micro"],
                    publisher=r["publisher_id"], royalty_micro=r["royalty_micro"],
                    fee_micro=r["fee_micro"], vests_at=_utc(r["vests_at"]),
                    vest_transaction_id=r["vest_transaction_id"],
                    refund_transaction_id=r["refund_transaction_id"],
                    other_royalties=tuple((p, m) for p, m in r["other_royalties"] or ()))

    def add_hold(self, hold: Hold) -> None:
        _INSERT_HOLD.run(self.c, self._hold_values(hold))

    def save_hold(self, hold: Hold) -> None:
        # Only what may change after add_hold (fewer values to convert and send).
        _UPDATE_HOLD.run(self.c, {"w_id": hold.id, **self._hold_changes(hold)})

    def get_hold(self, hold_id: str, *, for_update: bool = False) -> Hold | None:
        query = _HOLD_FOR_UPDATE if for_update and self._lock_rows else _HOLD
        row = query.run(self.c, {"w_id": hold_id}).mapping()
        return self._hold(row) if row else None

    def post_hold(self, hold_id: str, *, now: datetime, transaction_id: str, splits: Splits,
                  vests_at: datetime) -> Hold | None:
        result = _POST_HOLD[self._returning].run(
            self.c, self._post_hold_params(hold_id, now, transaction_id, splits, vests_at))
        if self._returning:
            row = result.mapping()
        else:
            row = _HOLD.run(self.c, {"w_id": hold_id}).mapping() if result.rowcount == 1 else None
        return self._hold(row) if row else None

    def post_holds(self, posts: Sequence[tuple[str, str, Splits, datetime]], *,
                   now: datetime) -> list[Hold | None]:
        """Every post_hold in one pipeline (psycopg; see Prepared.run_each), each with
        RETURNING; one post_hold each where the database has no RETURNING."""
        if not self._returning:
            return [self.post_hold(hold_id, now=now, transaction_id=txn_id, splits=splits,
                                   vests_at=vests_at)
                    for hold_id, txn_id, splits, vests_at in posts]
        results = _POST_HOLD[True].run_each(self.c, [
            self._post_hold_params(hold_id, now, txn_id, splits, vests_at)
            for hold_id, txn_id, splits, vests_at in posts])
        return [self._hold(r.mapping()) if r.rows else None for r in results]

    @staticmethod
    def _post_hold_params(hold_id: str, now: datetime, transaction_id: str, splits: Splits,
                          vests_at: datetime) -> dict:
        return {"w_id": hold_id, "w_now": now, "w_captured": splits.captured_micro,
                "state": HoldState.POSTED.value, "resolved_at": now,
                "resolve_transaction_id": transaction_id,
                "captured_micro": splits.captured_micro,
                "provider_id": splits.provider, "provider_micro": splits.provider_micro,
                "publisher_id": splits.publisher, "royalty_micro": splits.royalty_micro,
                "other_royalties": _stored_royalties(splits.other_royalties),
                "fee_micro": splits.fee_micro, "vests_at": vests_at}

    def due_hold_ids(self, now: datetime, *, limit: int) -> list[str]:
        return list(self.c.scalars(
            select(holds_t.c.id).where(holds_t.c.state == HoldState.PENDING.value,
                                       holds_t.c.expires_at <= now)
            .order_by(holds_t.c.expires_at, holds_t.c.id).limit(limit)))

    def unvested_holds(self, provider: str, *, due_by: datetime | None = None,
                       lock: bool = False) -> list[Hold]:
        cond = [holds_t.c.provider_id == provider, holds_t.c.state == HoldState.POSTED.value,
                holds_t.c.provider_micro > 0, holds_t.c.vest_transaction_id.is_(None),
                holds_t.c.refund_transaction_id.is_(None)]
        if due_by is not None:
            cond.append(holds_t.c.vests_at <= due_by)
        query = select(holds_t).where(*cond).order_by(holds_t.c.id)
        if lock and self._lock_rows:
            query = query.with_for_update()
        return [self._hold(r) for r in self.c.execute(query).mappings()]

    # idempotency
    def get_idempotency(self, key: str) -> IdempotencyRecord | None:
        row = _IDEMPOTENCY.run(self.c, {"w_key": key}).mapping()
        if row is None:
            return None
        return IdempotencyRecord(key=row["key"], operation=row["operation"],
                                 fingerprint=row["fingerprint"], result_type=row["result_type"],
                                 result_id=row["result_id"], created_at=_utc(row["created_at"]))

    def add_idempotency(self, record: IdempotencyRecord) -> bool:
        return _CLAIM_IDEMPOTENCY[self.c.dialect.name].run(self.c, {
            "key": record.key, "operation": record.operation, "fingerprint": record.fingerprint,
            "result_type": record.result_type, "result_id": record.result_id,
            "created_at": record.created_at}).rowcount == 1

    def add_idempotencies(self, records: Sequence[IdempotencyRecord]) -> int:
        rows = [{"key": r.key, "operation": r.operation, "fingerprint": r.fingerprint,
                 "result_type": r.result_type, "result_id": r.result_id,
                 "created_at": r.created_at} for r in records]
        if not rows:
            return 0
        dialect = self.c.dialect.name
        if not self._multi_row:
            return _CLAIM_IDEMPOTENCY[dialect].run(self.c, rows).rowcount
        return insert_rows(self.c, idempotency_t, rows, claim=dialect)

    # audit
    def audit(self) -> tuple[int, int, list[str]]:
        problems: list[str] = []
        total = self.c.scalar(select(func.coalesce(func.sum(entries_t.c.amount_micro), 0)))
        count = self.c.scalar(select(func.count()).select_from(transactions_t))
        for tid, s in self.c.execute(
                select(entries_t.c.transaction_id, func.sum(entries_t.c.amount_micro))
                .group_by(entries_t.c.transaction_id)
                .having(func.sum(entries_t.c.amount_micro) != 0)):
            problems.append(f"transaction {tid} sums to {s}")
        sums = (select(entries_t.c.account_id, func.sum(entries_t.c.amount_micro).label("s"))
                .group_by(entries_t.c.account_id).subquery())
        computed = func.coalesce(sums.c.s, 0)
        for key, cached, s, allow_negative in self.c.execute(
                select(accounts_t.c.id, accounts_t.c.balance_micro, computed,
                       accounts_t.c.allow_negative)
                .outerjoin(sums, sums.c.account_id == accounts_t.c.id)):
            if cached != s:
                problems.append(f"{key}: cached balance {cached}, entries sum {s}")
            if s < 0 and not (allow_negative and AccountKind(key.partition(":")[0]).allows_negative):
                problems.append(f"{key} is negative ({s}) but its kind forbids it")
        return int(total), int(count), problems
