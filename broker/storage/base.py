"""The declarative base every table derives from, and engine creation for both backends."""
from __future__ import annotations

import itertools
import logging
import sqlite3
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from sqlalchemy import MetaData, create_engine, event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import DeclarativeBase

log = logging.getLogger(__name__)

# Stable constraint names, so Alembic migrations are identical on SQLite and PostgreSQL.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class _SerialSQLiteConnection(sqlite3.Connection):
    """A sqlite3 connection whose transactions take an in-process lock from BEGIN to
    COMMIT/ROLLBACK. SQLite allows one writer at a time; without the lock, threads that
    collide fall into SQLite's busy handler, which sleeps 1, 2, 5, 10… ms between retries
    and turns a sub-millisecond wait into tens of milliseconds."""

    writer_lock: threading.Lock
    holding = False
    query_only = False

    def begin_serial(self) -> None:
        self.writer_lock.acquire()
        self.holding = True

    def begin_query_only(self) -> None:
        """Inside this thread's :func:`atomic` block the writer lock is already held (by the
        block's own connection): this connection may read, and a write fails at once with
        "attempt to write a readonly database" instead of deadlocking on the lock."""
        self.execute("PRAGMA query_only = ON")
        self.query_only = True

    def _release(self) -> None:
        if self.query_only:
            self.query_only = False
            self.execute("PRAGMA query_only = OFF")
        if self.holding:
            self.holding = False
            self.writer_lock.release()

    def commit(self):
        try:
            super().commit()
        finally:
            self._release()

    def rollback(self):
        try:
            super().rollback()
        finally:
            self._release()


_READ_ONLY = "sparecycles_read_only"


@contextmanager
def read_only(engine: Engine) -> Iterator[Connection]:
    """A connection for a single SELECT (``with read_only(engine) as c: c.execute(...)``).

    On SQLite it takes neither the in-process writer lock nor ``BEGIN IMMEDIATE``: one
    statement is atomic by itself and, in WAL mode, reads the last committed state without
    waiting for a writer, so reads stop queueing behind writes. Reads that need several
    statements to agree, and anything that writes, use ``engine.begin()``. On PostgreSQL
    it is an ordinary connection. Inside this thread's :func:`atomic` block it is that
    block's own connection: the read sees what the block wrote so far, and the block never
    waits for a second connection from the pool (which threads queued behind its writer
    lock could be holding)."""
    tx = current(engine)
    if tx is not None:
        yield tx.conn
        return
    with engine.connect().execution_options(**{_READ_ONLY: True}) as conn:
        yield conn


# ---- one transaction across repositories -----------------------------------------------
_ambient = threading.local()
_savepoints = itertools.count(1)


class Tx:
    """The transaction an :func:`atomic` block opened: its connection, and what runs around
    its commit. ``defer(owner, item)`` queues work for the end of the transaction:
    ``owner.before_commit(tx, items)`` runs once with all of its items, last thing before
    COMMIT, in the transaction (the audit log appends its entries there, so the hash chain
    is extended by exactly the transactions that commit). Items deferred inside a savepoint
    that rolls back are dropped with it."""

    __slots__ = ("engine", "conn", "_deferred", "_after_commit", "_after_rollback")

    def __init__(self, engine: Engine, conn: Connection):
        self.engine, self.conn = engine, conn
        self._deferred: list[tuple[Any, Any]] = []
        self._after_commit: list[Callable[[], None]] = []
        self._after_rollback: list[Callable[[], None]] = []

    def defer(self, owner: Any, item: Any) -> None:
        self._deferred.append((owner, item))

    def after_commit(self, fn: Callable[[], None]) -> None:
        self._after_commit.append(fn)

    def after_rollback(self, fn: Callable[[], None]) -> None:
        self._after_rollback.append(fn)

    def _before_commit(self) -> None:
        groups: dict[int, tuple[Any, list]] = {}
        for owner, item in self._deferred:
            groups.setdefault(id(owner), (owner, []))[1].append(item)
        self._deferred = []
        for owner, items in groups.values():
            owner.before_commit(self, items)


def current(engine: Engine) -> Tx | None:
    """This thread's open :func:`atomic` transaction on ``engine``, if any."""
    tx = getattr(_ambient, "tx", None)
    return tx if tx is not None and tx.engine is engine else None


@contextmanager
def atomic(engine: Engine) -> Iterator[Tx]:
    """One database transaction for everything the block writes through :func:`begin` on
    this thread: a job with its hold, a settlement with its ledger post and their audit
    entries commit together or not at all, in one COMMIT instead of one each. A block inside
    another joins it. Only :func:`begin` (and :func:`read_only` reads) may be used inside:
    on SQLite another connection can read but not write (its writes fail at once; the
    writer lock is this block's)."""
    tx = current(engine)
    if tx is not None:
        yield tx
        return
    committed = False
    try:
        with engine.begin() as conn:
            tx = Tx(engine, conn)
            _ambient.tx = tx
            try:
                yield tx
                tx._before_commit()
            finally:
                _ambient.tx = None
        committed = True
    finally:
        # Each hook runs even if one before it failed, and none undoes the outcome: a
        # failure is logged (after a commit, the block's writes stand).
        for fn in (tx._after_commit if committed else tx._after_rollback) if tx else ():
            try:
                fn()
            except Exception:  # noqa: BLE001
                log.exception("a hook after %s failed", "COMMIT" if committed else "ROLLBACK")


@contextmanager
def begin(engine: Engine) -> Iterator[Connection]:
    """``engine.begin()`` for repositories: a transaction of its own, or, inside this
    thread's :func:`atomic` block, a SAVEPOINT in that block's transaction, so a failed
    step (a refused ledger operation, a unique key another writer took) undoes only itself
    and the caller may retry it or go on without it."""
    tx = current(engine)
    if tx is None:
        with engine.begin() as conn:
            yield conn
        return
    name = f"sc_sp{next(_savepoints)}"
    raw = tx.conn.connection.dbapi_connection
    mark = len(tx._deferred)
    _raw(raw, f"SAVEPOINT {name}")
    try:
        yield tx.conn
    except BaseException:
        _raw(raw, f"ROLLBACK TO SAVEPOINT {name}")
        _raw(raw, f"RELEASE SAVEPOINT {name}")
        del tx._deferred[mark:]
        raise
    _raw(raw, f"RELEASE SAVEPOINT {name}")


def _raw(dbapi_conn, sql: str) -> None:
    """One statement straight on the driver (a savepoint costs two; through
    ``Connection.execute`` each would cost more Python than SQLite takes to run it)."""
    cursor = dbapi_conn.cursor()
    try:
        cursor.execute(sql)
    finally:
        cursor.close()


def make_engine(url: str, *, pool_size: int = 10) -> Engine:
    """An engine for ``url``. SQLite gets WAL, a busy timeout and foreign keys; its
    transactions start with BEGIN IMMEDIATE so that read-then-write never deadlocks, and
    are serialised in-process (see _SerialSQLiteConnection); single reads through
    :func:`read_only` skip both."""
    if url.startswith("sqlite"):
        # No cap on connections: a capped pool can deadlock, every connection held by a
        # thread queued on the writer lock while the lock's holder waits for one more.
        # (SQLite connections are a file handle each; the threads that use them are the
        # server's bounded pools.)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30,
                                                  "factory": _SerialSQLiteConnection},
                               pool_size=pool_size, max_overflow=-1)
        writer_lock = threading.Lock()

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            dbapi_conn.writer_lock = writer_lock
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn):
            if conn.get_execution_options().get(_READ_ONLY):
                return  # autocommit mode: the SELECT is its own (read) transaction
            dbapi_conn = conn.connection.dbapi_connection
            if current(engine) is not None:
                dbapi_conn.begin_query_only()  # see atomic(): reads only, never a deadlock
                return
            dbapi_conn.begin_serial()
            try:
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            except BaseException:
                dbapi_conn._release()
                raise

        return engine
    return create_engine(url, pool_size=pool_size, max_overflow=20, pool_pre_ping=True)
