"""Shared fixtures. Storage and ledger tests take ``db_url``, which runs them once on a
fresh SQLite file and once on a fresh PostgreSQL database (SPARECYCLES_TEST_POSTGRES_URL,
default the local server; skipped with a reason when it cannot be reached, and failed
instead when SPARECYCLES_REQUIRE_POSTGRES=1, as in CI)."""
from __future__ import annotations

import os
import uuid

import pytest

PG_ADMIN_URL = os.environ.get("SPARECYCLES_TEST_POSTGRES_URL",
                              "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def _pg_database():
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    admin = make_url(PG_ADMIN_URL)
    name = f"sc_test_{uuid.uuid4().hex[:12]}"
    try:
        engine = create_engine(admin, isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # noqa: BLE001 - any connection failure means "no server"
        if os.environ.get("SPARECYCLES_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"PostgreSQL at {PG_ADMIN_URL} is required but unreachable: {exc}")
        pytest.skip(f"PostgreSQL at {PG_ADMIN_URL} unreachable: {exc}")
    return engine, admin.set(database=name).render_as_string(hide_password=False), name


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    """A URL of an empty database, on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'broker.db'}"
        return
    from sqlalchemy import text

    engine, url, name = _pg_database()
    yield url
    with engine.connect() as conn:
        conn.execute(text(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name})
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
    engine.dispose()


@pytest.fixture
def pg_url():
    """A fresh PostgreSQL database only (for concurrency tests)."""
    from sqlalchemy import text

    engine, url, name = _pg_database()
    yield url
    with engine.connect() as conn:
        conn.execute(text(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name})
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
    engine.dispose()
