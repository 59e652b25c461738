"""The declarative base every table derives from, and engine creation for both backends."""
from __future__ import annotations

import sqlite3
import threading

from sqlalchemy import MetaData, create_engine, event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import DeclarativeBase

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

    def begin_serial(self) -> None:
        self.writer_lock.acquire()
        self.holding = True

    def _release(self) -> None:
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


def read_only(engine: Engine) -> Connection:
    """A connection for a single SELECT (``with read_only(engine) as c: c.execute(...)``).

    On SQLite it takes neither the in-process writer lock nor ``BEGIN IMMEDIATE``: one
    statement is atomic by itself and, in WAL mode, reads the last committed state without
    waiting for a writer, so reads stop queueing behind writes. Reads that need several
    statements to agree, and anything that writes, use ``engine.begin()``. On PostgreSQL
    it is an ordinary connection."""
    return engine.connect().execution_options(**{_READ_ONLY: True})


def make_engine(url: str, *, pool_size: int = 10) -> Engine:
    """An engine for ``url``. SQLite gets WAL, a busy timeout and foreign keys; its
    transactions start with BEGIN IMMEDIATE so that read-then-write never deadlocks, and
    are serialised in-process (see _SerialSQLiteConnection); single reads through
    :func:`read_only` skip both."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30,
                                                  "factory": _SerialSQLiteConnection})
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
            dbapi_conn.begin_serial()
            try:
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            except BaseException:
                dbapi_conn._release()
                raise

        return engine
    return create_engine(url, pool_size=pool_size, max_overflow=20, pool_pre_ping=True)
