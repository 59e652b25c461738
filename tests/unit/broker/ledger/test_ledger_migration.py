"""The ledger's migrations (0002_ledger, then 0013_hold_other_royalties) create exactly
the schema of the ledger's models, and undo it."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy import MetaData, inspect

from broker.storage.base import NAMING, make_engine
from broker.storage.ledger_sql import LEDGER_TABLES

VERSIONS = Path(__file__).resolve().parents[4] / "broker/storage/migrations/versions"


def _load_migration(name: str):
    spec = importlib.util.spec_from_file_location(f"migration_{name}", VERSIONS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_migration_matches_models(db_url):
    migration, royalties = _load_migration("0002_ledger"), _load_migration(
        "0013_hold_other_royalties")
    assert (migration.revision, migration.down_revision) == ("0002_ledger", "0001_spine")
    engine = make_engine(db_url)
    ledger_only = MetaData(naming_convention=NAMING)
    for table in LEDGER_TABLES:
        table.to_metadata(ledger_only)
    try:
        with engine.begin() as conn:
            with Operations.context(MigrationContext.configure(conn)):
                migration.upgrade()
                royalties.upgrade()
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}),
                                    ledger_only)
        assert diff == [], diff
        checks = {t.name: {c["name"] for c in inspect(engine).get_check_constraints(t.name)}
                  for t in LEDGER_TABLES}
        expected = {t.name: {c.name for c in t.constraints if c.__class__.__name__ == "CheckConstraint"
                             and c.name} for t in LEDGER_TABLES}
        assert checks == expected
        with engine.begin() as conn:
            with Operations.context(MigrationContext.configure(conn)):
                royalties.downgrade()
                migration.downgrade()
        assert not set(inspect(engine).get_table_names()) & {t.name for t in LEDGER_TABLES}
    finally:
        engine.dispose()
