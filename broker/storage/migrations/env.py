"""Alembic environment: uses the engine handed over by broker.storage.migrate."""
from alembic import context

from broker.storage.base import Base
import broker.storage.all_models  # noqa: F401 - registers every table on Base.metadata

config = context.config
engine = config.attributes["engine"]

with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=Base.metadata,
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
