"""Run the Alembic migrations programmatically (``broker serve`` does it at start)."""
from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Engine

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def alembic_config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["engine"] = engine
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    command.upgrade(alembic_config(engine), revision)


def downgrade(engine: Engine, revision: str) -> None:
    command.downgrade(alembic_config(engine), revision)


_HEADS: dict[str, frozenset[str]] = {}


def schema_behind(engine: Engine) -> str | None:
    """None when the database's schema is at the migrations' head; else what is wrong, in
    words (``sparecycles broker migrate`` or a restart of ``serve`` brings it up)."""
    from alembic.script import ScriptDirectory
    from sqlalchemy import inspect, text

    heads = _HEADS.get(str(MIGRATIONS))
    if heads is None:  # the scripts are read once per process
        heads = _HEADS[str(MIGRATIONS)] = frozenset(
            ScriptDirectory.from_config(alembic_config(engine)).get_heads())
    # Read as a plain statement: alembic's MigrationContext logs two INFO lines each time,
    # and this runs on every /readyz and every health check.
    with engine.connect() as conn:
        try:
            current = frozenset(r[0] for r in conn.execute(
                text("SELECT version_num FROM alembic_version")))
        except Exception:  # noqa: BLE001 - no such table: nothing was migrated
            conn.rollback()
            if inspect(conn).has_table("alembic_version"):
                raise
            current = frozenset()
    if current == heads:
        return None
    if not current:
        return "the database has no schema yet (no migration ran)"
    return (f"the database schema is at {', '.join(sorted(current))}, this broker needs "
            f"{', '.join(sorted(heads))}")
