"""SQL storage (SQLAlchemy 2 + Alembic): SQLite (WAL) embedded, PostgreSQL in production."""
