"""Counts of the statements and COMMITs this process's database connections run, for the
dispatch benchmark's "statements and commits per job" (issue #28). Off unless
``SPARECYCLES_COUNT_STATEMENTS=1`` (every statement then costs a Python call more); when on,
``/metrics`` shows them as ``sparecycles_db_statements_total`` and
``sparecycles_db_commits_total``.

Counted at the driver, under SQLAlchemy and the prepared statements of broker/storage/fast.py
alike: on SQLite through the connection's trace callback (every statement SQLite runs,
BEGIN, SAVEPOINT and COMMIT included), on PostgreSQL through a cursor class that counts its
``execute``/``executemany`` calls (one each, however many rows) and SQLAlchemy's ``commit``
event.
"""
from __future__ import annotations

import os
import threading

ENV = "SPARECYCLES_COUNT_STATEMENTS"


class StatementCounts:
    def __init__(self):
        self.statements = 0
        self.commits = 0
        self._lock = threading.Lock()

    def statement(self, sql: str = "") -> None:
        with self._lock:
            self.statements += 1
            if sql[:6].upper() == "COMMIT":
                self.commits += 1

    def commit(self) -> None:
        with self._lock:
            self.commits += 1

    def collect(self):
        """The two counters as Prometheus metric families (at scrape time)."""
        from prometheus_client.core import CounterMetricFamily

        for name, doc, value in (
                ("sparecycles_db_statements", "Statements this process ran on its database "
                 "(counted only with SPARECYCLES_COUNT_STATEMENTS=1).", self.statements),
                ("sparecycles_db_commits", "COMMITs this process ran on its database "
                 "(counted only with SPARECYCLES_COUNT_STATEMENTS=1).", self.commits)):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family


COUNTS = StatementCounts()


def enabled() -> bool:
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "off", "false", "no"):
        return False
    if value in ("1", "on", "true", "yes"):
        return True
    raise ValueError(f"{ENV}={value!r}: give 1 (count the database statements) or 0")


def install(engine, *, sqlite: bool) -> None:
    """Count ``engine``'s statements and commits into COUNTS."""
    from sqlalchemy import event

    if sqlite:
        @event.listens_for(engine, "connect")
        def _trace(dbapi_conn, _record):
            dbapi_conn.set_trace_callback(COUNTS.statement)
        return

    import psycopg

    class CountingCursor(psycopg.Cursor):
        def execute(self, *args, **kwargs):
            COUNTS.statement()
            return super().execute(*args, **kwargs)

        def executemany(self, *args, **kwargs):
            COUNTS.statement()
            return super().executemany(*args, **kwargs)

    @event.listens_for(engine, "connect")
    def _count_cursors(dbapi_conn, _record):
        dbapi_conn.cursor_factory = CountingCursor

    @event.listens_for(engine, "commit")
    def _count_commit(_conn):
        COUNTS.commit()
