"""Run the Alembic migrations programmatically.

``sparecycles broker migrate`` runs :func:`upgrade`; on PostgreSQL it holds an advisory lock
for the whole upgrade, so replicas (or deploy jobs) started together migrate one after the
other and the later ones find nothing to do. ``broker serve`` on PostgreSQL only checks
(:func:`require_current`) and refuses a database that is behind; on the embedded SQLite
default (one broker process, nobody to coordinate with) it upgrades at start.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Engine

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
#: pg_advisory_lock key of the migrations (any constant all replicas agree on).
MIGRATE_LOCK_KEY = 0x5C_6D_69_67  # "\\x5cmig"


class NotMigrated(RuntimeError):
    """The database's schema is not the one this broker needs."""


def alembic_config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["engine"] = engine
    return cfg


@contextmanager
def _migration_lock(engine: Engine):
    """On PostgreSQL, an advisory lock held on a connection of its own for the block."""
    if engine.dialect.name != "postgresql":
        yield
        return
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATE_LOCK_KEY})
        conn.commit()
        try:
            yield
        finally:
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATE_LOCK_KEY})
            conn.commit()


def upgrade(engine: Engine, revision: str = "head") -> None:
    with _migration_lock(engine):
        command.upgrade(alembic_config(engine), revision)


def downgrade(engine: Engine, revision: str) -> None:
    with _migration_lock(engine):
        command.downgrade(alembic_config(engine), revision)


def heads() -> set[str]:
    """The revisions this code's migrations end at."""
    return set(ScriptDirectory.from_config(alembic_config(None)).get_heads())


def current(engine: Engine) -> set[str]:
    """The revisions the database is at (empty: never migrated)."""
    with engine.connect() as conn:
        return set(MigrationContext.configure(conn).get_current_heads())


def require_current(engine: Engine, db_shown: str) -> None:
    """Raise :class:`NotMigrated`, saying what to run, unless the database is at head."""
    want, have = heads(), current(engine)
    if have == want:
        return
    if not have:
        state = "has no broker tables yet (never migrated)"
    elif have - want and not want - have:
        state = f"is at {', '.join(sorted(have))}, newer than this broker ({', '.join(sorted(want))})"
    else:
        state = f"is at revision {', '.join(sorted(have))}; this broker needs {', '.join(sorted(want))}"
    if have - want and not want - have:
        raise NotMigrated(f"the database {db_shown} {state}: upgrade this broker to the "
                          "version the other replicas run")
    raise NotMigrated(f"the database {db_shown} {state}. Run `sparecycles broker migrate "
                      f"--db {db_shown}` once (it takes an advisory lock, so running it "
                      "from several replicas at once is safe), then start the broker again")


_HEADS: set[str] | None = None


def schema_behind(engine: Engine) -> str | None:
    """None when the database's schema is at the migrations' head; else what is wrong, in
    words, for /readyz (``sparecycles broker migrate`` brings it up)."""
    from sqlalchemy import inspect, text

    global _HEADS
    if _HEADS is None:  # the scripts are read once per process
        _HEADS = heads()
    # Read as a plain statement: alembic's MigrationContext logs two INFO lines each time,
    # and this runs on every /readyz and every health check.
    with engine.connect() as conn:
        try:
            have = {r[0] for r in conn.execute(text("SELECT version_num FROM alembic_version"))}
        except Exception:  # noqa: BLE001 - no such table: nothing was migrated
            conn.rollback()
            if inspect(conn).has_table("alembic_version"):
                raise
            have = set()
    if have == _HEADS:
        return None
    if not have:
        return "the database has no schema yet (no migration ran)"
    return (f"the database schema is at {', '.join(sorted(have))}, this broker needs "
            f"{', '.join(sorted(_HEADS))}")

