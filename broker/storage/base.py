"""The declarative base every table derives from, and engine creation for both backends."""
from __future__ import annotations

import logging
import sqlite3
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from sqlalchemy import MetaData, create_engine, event, exc
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import DeclarativeBase

from . import counting

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
    shared_writer = False  # the engine's one writer connection (see _Writer)
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
    own = _own(engine)
    if own is None:
        with engine.connect().execution_options(**{_READ_ONLY: True}) as conn:
            yield conn
        return
    conn = own.reader
    if conn is None or conn.closed or conn.invalidated:
        conn = own.reader = _open_reader(engine, own)
    own.reading += 1
    try:
        yield conn
    finally:
        own.reading -= 1
        if not own.reading and conn.in_transaction():
            _end(conn)  # an SQLAlchemy-level "transaction" only: autocommit underneath


class _Own:
    """One thread's own read connection to one SQLite engine, kept open between uses:
    taking a connection from the pool and giving it back (a Connection object, checkout,
    reset, checkin, events) cost more Python than the statement it ran. Closed when the
    thread ends or the engine is disposed. PostgreSQL keeps its capped pool (its
    connections are server processes; the broker's threads outnumber them)."""

    __slots__ = ("reader", "reading", "__weakref__")

    def __init__(self):
        self.reader: Connection | None = None
        self.reading = 0

    def close(self) -> None:
        conn, self.reader = self.reader, None
        if conn is not None and not conn.closed:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                log.debug("closing a thread's own connection failed", exc_info=True)

    def __del__(self):  # the thread ended: give its connections back, not to the GC
        self.close()


def _own(engine: Engine) -> _Own | None:
    """This thread's :class:`_Own` connections to ``engine`` (None: use the pool)."""
    local = engine.__dict__.get("_sc_own")
    if local is None:
        return None
    own = getattr(local, "own", None)
    if own is None:
        own = local.own = _Own()
        engine._sc_owners.add(own)
    return own


def _open_reader(engine: Engine, own: _Own) -> Connection:
    own.close()  # the broken one, if any
    return engine.connect().execution_options(**{_READ_ONLY: True})


def _end(conn: Connection) -> None:
    try:
        conn.rollback()
    except Exception:  # noqa: BLE001 - the connection is broken: the next use reopens it
        log.debug("ending a read failed", exc_info=True)
        conn.invalidate()


@contextmanager
def _transaction(engine: Engine) -> Iterator[Connection]:
    """``engine.begin()``; on SQLite, a member of the writer's group commit (see
    :class:`_Writer`)."""
    writer = engine.__dict__.get("_sc_writer")
    if writer is None:
        with engine.begin() as conn:
            yield conn
        return
    with writer.member() as conn:
        yield conn


class _Group:
    """One SQLite transaction that several threads' transactions share (see _Writer)."""

    __slots__ = ("conn", "trans", "members", "done", "error")

    def __init__(self, conn: Connection):
        self.conn = conn
        self.trans = conn.begin()  # BEGIN IMMEDIATE (see make_engine's "begin" listener)
        self.members = 0  # transactions in it that succeeded, waiting for its COMMIT
        self.done = threading.Event()
        self.error: BaseException | None = None


class GroupCommitFailed(exc.OperationalError):
    """The COMMIT of the transaction this one shared failed: nothing of it was written."""


class _Writer:
    """SQLite's one writer connection, and its group commit.

    One connection does all the writing: SQLite allows one writer at a time anyway, and
    with one connection its page cache stays valid between transactions (in WAL mode a
    connection drops its whole cache whenever another connection wrote since its last
    transaction, so every write used to start by reading back the pages it changed).

    Transactions take turns on it, one body at a time, each inside a SAVEPOINT of one
    shared SQLite transaction: when a body is done and other threads wait for their turn,
    its work stays uncommitted and the next body runs in the same transaction; the last
    one of the group (nobody waiting, or MAX_GROUP in it) COMMITs for all, and each waits
    for that COMMIT before its ``with`` block returns, so a caller never sees its write
    before it is durable. A COMMIT costs about 0.2 ms here (it writes every page the
    transaction changed to the WAL, a few system calls each), as much as the statements
    of a small transaction, so under load a few transactions share one. A body that
    fails rolls back to its savepoint, undoing only itself; a failed COMMIT fails every
    member. Another connection that writes (an ORM session) takes ``lock``, which the
    group holds from BEGIN to COMMIT.

    The bodies of one group see each other's writes before they commit, which is what one
    writer after another would see; and a thread waiting for its group's COMMIT waits for
    other bodies, as it would wait for the writer lock: a lock held across a transaction
    must not be taken inside another (the audit log's is not held across a grouped one)."""

    MAX_GROUP = 16

    def __init__(self, engine: Engine, lock: threading.Lock):
        self.engine = engine
        self.lock = lock  # the lock every other SQLite transaction takes
        self.conn: Connection | None = None
        self.turn = threading.Lock()  # held by the body running now
        self._counting = threading.Lock()
        self.waiting = 0  # threads waiting for a turn
        self.group: _Group | None = None
        # Transactions rolled back after they began (a member's, or a whole group's):
        # anything cached from what they wrote is stale once this changes.
        self.rollbacks = 0

    def connection(self) -> Connection:
        """The connection (the caller holds the lock); a broken one is replaced."""
        conn = self.conn
        if conn is None or conn.closed or conn.invalidated:
            if conn is not None and not conn.closed:
                try:
                    conn.close()
                except Exception:  # noqa: BLE001
                    log.debug("closing a broken writer connection failed", exc_info=True)
            conn = self.conn = self.engine.connect()
            conn.connection.dbapi_connection.shared_writer = True
        return conn

    @contextmanager
    def member(self) -> Iterator[Connection]:
        """One transaction: a turn in the open group (a new group if none is open)."""
        with self._counting:
            self.waiting += 1
        self.turn.acquire()
        with self._counting:
            self.waiting -= 1
        group = self.group
        if group is None:
            try:
                self.lock.acquire()
                try:
                    group = _Group(self.connection())
                except BaseException:
                    self.lock.release()
                    raise
            except BaseException:
                self.turn.release()
                raise
            self.group = group
        raw = group.conn.connection.dbapi_connection
        try:
            _raw(raw, "SAVEPOINT sc_member")
        except BaseException as error:
            self._end(group, error)
            raise
        try:
            yield group.conn
        except BaseException as failure:
            try:
                _raw(raw, "ROLLBACK TO SAVEPOINT sc_member")
                _raw(raw, "RELEASE SAVEPOINT sc_member")
            except BaseException as error:  # the transaction is gone: all of it is lost
                log.warning("the shared SQLite transaction was lost while undoing a failed "
                            "one (%s): its other members fail too", error)
                self._end(group, error)
                raise failure from None
            self.rollbacks += 1
            self._end(group)  # the others' work goes on (or commits) without this one's
            raise
        try:
            _raw(raw, "RELEASE SAVEPOINT sc_member")
        except BaseException as error:
            self._end(group, error)
            raise
        group.members += 1
        if self._end(group):
            group.done.wait()
        if group.error is not None:
            raise GroupCommitFailed("COMMIT", None, group.error) from group.error

    def _end(self, group: _Group, failed: BaseException | None = None) -> bool:
        """End this thread's turn (the caller holds it): pass the open transaction to the
        next thread waiting (True: wait for ``group.done``), or COMMIT the group (ROLLBACK
        when it failed or has no member) and wake its members."""
        if failed is None and self.waiting and group.members < self.MAX_GROUP:
            self.turn.release()
            return True
        self.group = None
        try:
            if failed is None and group.members:
                group.trans.commit()
            else:
                group.error = failed if group.members else None
                group.trans.rollback()
        except BaseException as error:  # noqa: BLE001 - handed to every member
            group.error = group.error or error
            try:
                group.conn.invalidate()  # the next group opens a new one
            except Exception:  # noqa: BLE001
                log.debug("invalidating the writer connection failed", exc_info=True)
        finally:
            if group.error is not None:
                self.rollbacks += 1
            self.lock.release()
            group.done.set()
            self.turn.release()
        return False

    def close(self) -> None:
        while True:
            with self.turn:
                if self.group is None:  # no group open, so no member waits for one
                    with self.lock:
                        if self.conn is not None and not self.conn.closed:
                            self.conn.close()
                        self.conn = None
                    return
            time.sleep(0.001)


# ---- one transaction across repositories -----------------------------------------------
_ambient = threading.local()


class Tx:
    """The transaction an :func:`atomic` block opened: its connection, and what runs around
    its commit. ``defer(owner, item)`` queues work for the end of the transaction:
    ``owner.before_commit(tx, items)`` runs once with all of its items, last thing before
    COMMIT, in the transaction (the audit log appends its entries there, so the hash chain
    is extended by exactly the transactions that commit). Items deferred inside a savepoint
    that rolls back are dropped with it.

    ``grouped``: the transaction is a member of SQLite's group commit (see _Writer), so
    transactions run one at a time and the next may start before this one commits;
    ``epoch`` counts the transactions rolled back before it began (a cache of what an
    uncommitted transaction wrote is stale once it changes)."""

    __slots__ = ("engine", "conn", "depth", "grouped", "epoch", "flat", "_deferred",
                 "_after_commit", "_after_rollback")

    def __init__(self, engine: Engine, conn: Connection):
        self.engine, self.conn = engine, conn
        writer = engine.__dict__.get("_sc_writer")
        self.grouped = writer is not None
        self.epoch = writer.rollbacks if writer is not None else 0
        self.depth = 0  # savepoints open (see begin)
        self.flat = False  # begin() opens no savepoint (see flat())
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
    writer lock is this block's). On SQLite the block's transaction may share its COMMIT
    with others' (see _Writer); either way the block returns once its writes are
    committed, and its ``after_commit`` hooks run then."""
    tx = current(engine)
    if tx is not None:
        yield tx
        return
    committed = False
    try:
        with _transaction(engine) as conn:
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
        with _transaction(engine) as conn:
            yield conn
        return
    if tx.flat:  # see flat(): a failure here undoes the whole block
        yield tx.conn
        return
    # Named by depth: a savepoint's name is free again once it is released, and the same
    # few statements stay in the driver's statement cache instead of being parsed anew.
    tx.depth += 1
    name = f"sc_sp{tx.depth}"
    raw = tx.conn.connection.dbapi_connection
    mark = len(tx._deferred)
    try:
        _raw(raw, f"SAVEPOINT {name}")
        try:
            yield tx.conn
        except BaseException:
            _raw(raw, f"ROLLBACK TO SAVEPOINT {name}")
            _raw(raw, f"RELEASE SAVEPOINT {name}")
            del tx._deferred[mark:]
            raise
        _raw(raw, f"RELEASE SAVEPOINT {name}")
    finally:
        tx.depth -= 1


@contextmanager
def flat(engine: Engine) -> Iterator[None]:
    """Inside this thread's :func:`atomic` block: the writes of the ``with`` block run in the
    block's transaction without a SAVEPOINT each (two statements fewer per write), so a
    failed one cannot be undone alone — the caller must let the exception end the whole
    atomic block and redo its work otherwise (a batch of settlements that falls back to
    one at a time). Outside an atomic block it changes nothing."""
    tx = current(engine)
    if tx is None or tx.flat:
        yield
        return
    tx.flat = True
    try:
        yield
    finally:
        tx.flat = False


def _raw(dbapi_conn, sql: str) -> None:
    """One statement straight on the driver (a savepoint costs two; through
    ``Connection.execute`` each would cost more Python than SQLite takes to run it)."""
    cursor = dbapi_conn.cursor()
    try:
        cursor.execute(sql)
    finally:
        cursor.close()


# The page size of a new SQLite database. Every COMMIT writes each page it changed, whole,
# to the WAL, and a job's three transactions change a page or more in each of some 25
# B-trees (tables and indexes), nearly all at their ends, where a few bytes change per
# page. At SQLite's default of 4096 bytes that came to about 650 KB of WAL per job; at
# 1024 it is about 150 KB (bench/dispatch.py, 1,000 jobs: 665 MB against 152 MB written),
# with the same number of pages and no more CPU. An existing database keeps the size it
# was made with (only a VACUUM outside WAL mode changes it).
SQLITE_PAGE_SIZE = 1024


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
            # Before anything is written (a database's page size is fixed once it has a
            # table, and WAL keeps it fixed): see SQLITE_PAGE_SIZE.
            cur.execute(f"PRAGMA page_size={SQLITE_PAGE_SIZE}")
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
            if not dbapi_conn.shared_writer:
                dbapi_conn.begin_serial()  # the writer connection's users hold the lock
            try:
                _raw(dbapi_conn, "BEGIN IMMEDIATE")
            except BaseException:
                dbapi_conn._release()
                raise

        # One writer connection (see _Writer); each thread keeps its own reader (see
        # _Own); dispose() closes them all.
        engine._sc_writer = writer = _Writer(engine, writer_lock)
        engine._sc_own = threading.local()
        engine._sc_owners = weakref.WeakSet()

        @event.listens_for(engine, "engine_disposed")
        def _on_dispose(_engine):
            writer.close()
            for own in list(engine._sc_owners):
                own.close()

        if counting.enabled():
            counting.install(engine, sqlite=True)
        return engine
    # LIFO: the connection checked in last goes out first, so under light load the few in
    # use stay warm (and unpinged) and the rest sit idle until pinged (_ping_when_idle).
    engine = create_engine(url, pool_size=pool_size, max_overflow=20, pool_use_lifo=True)
    _ping_when_idle(engine, PING_IDLE_S)
    if counting.enabled():
        counting.install(engine, sqlite=False)
    return engine


# A pooled PostgreSQL connection idle this long is pinged before it is used again.
PING_IDLE_S = 1.0


def _ping_when_idle(engine: Engine, idle_s: float) -> None:
    """``pool_pre_ping`` for the connections that may have gone stale: those that sat in the
    pool ``idle_s`` or longer (a database restart, a proxy's idle timeout). pool_pre_ping
    pinged every checkout — one round trip, 2.4 statements per job on the dispatch path
    (issue #28) — though a connection checked in milliseconds ago is as alive as one just
    pinged. A ping that fails raises DisconnectionError: the pool drops that connection
    and checks out another (a fresh one if need be), as pool_pre_ping does; a connection
    that dies while in use fails its statement, and SQLAlchemy then recycles the pool's
    others (its disconnect handling)."""
    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_conn, record):
        record.info["sc_idle_from"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_conn, record, _proxy):
        since = record.info.get("sc_idle_from")  # None: connected just now
        if since is None or time.monotonic() - since < idle_s:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)  # pool_pre_ping's own (no transaction left open)
        except Exception as e:  # noqa: BLE001 - any failure: take another connection
            raise exc.DisconnectionError(f"pooled connection failed its ping: {e}") from e
