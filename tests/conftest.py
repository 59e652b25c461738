"""Shared fixtures. Storage and ledger tests take ``db_url``, which runs them once on a
fresh SQLite file and once on a fresh PostgreSQL database (SPARECYCLES_TEST_POSTGRES_URL,
default the local server; skipped with a reason when it cannot be reached, and failed
instead when SPARECYCLES_REQUIRE_POSTGRES=1, as in CI)."""
from __future__ import annotations

import ast
import functools
import os
import sys
import threading
import uuid

import pytest


def _serialize_ast_conversion() -> None:
    """CPython 3.11 keeps the AST converter's recursion depth once per interpreter, not per
    thread (see python/cpython#106905 and pytest-dev/pytest#10763): two threads at it — one
    building a Flask app (werkzeug compiles each route through ``ast``), another formatting a
    traceback (3.11's carets ``ast.parse`` the line) — fail one of them with "SystemError: AST
    constructor recursion depth mismatch". The suite runs many brokers' threads in one
    process, so it takes both paths under one lock; a broker process builds its app once,
    before its threads start."""
    if sys.version_info >= (3, 12):
        return
    from werkzeug.routing import rules

    lock = threading.RLock()

    def locked(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with lock:
                return fn(*args, **kwargs)
        return wrapper

    ast.parse = locked(ast.parse)
    rules.Rule._compile_builder = locked(rules.Rule._compile_builder)


_serialize_ast_conversion()

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


# ---- a real S3 API (issue #24) --------------------------------------------------------------
S3_TEST_KEYS = {"access_key_id": "sparecycles-test", "secret_access_key": "sparecycles-test"}


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """The endpoint of moto's S3 server (with S3's expiry and checksum checks in front, see
    tests/s3_server.py) running in its own process on a free loopback port."""
    from tests.s3_server import S3Server

    with S3Server(log_path=tmp_path_factory.mktemp("s3") / "s3.log") as server:
        yield server.endpoint


def make_s3_store(endpoint: str, **kwargs):
    """An S3BlobStore on a new, empty bucket at ``endpoint``."""
    from broker.blobs.s3 import S3BlobStore

    store = S3BlobStore(f"sc-{uuid.uuid4().hex[:16]}", endpoint_url=endpoint,
                        region="us-east-1", path_style=True, **S3_TEST_KEYS, **kwargs)
    store.ensure_bucket()
    return store


@pytest.fixture
def s3_store(s3_endpoint):
    return make_s3_store(s3_endpoint)
