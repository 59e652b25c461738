"""Jobs' output format (``output_format``: png, webp or jpeg with a quality) and the result
cache (``cache``: the client opted in; ``cache_key``: what a later job must match to be
answered from this one's outputs; ``cached_from``: the job a cache hit was answered from),
and the admin's price of a cache hit per plugin (issue #24).

Revision ID: 0014_s3_outputs
Revises: 0014_observability_telemetry
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_s3_outputs"
down_revision = "0014_observability_telemetry"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("output_format", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("cache", sa.Boolean(), nullable=False,
                                   server_default=sa.false()))
        batch.add_column(sa.Column("cache_key", sa.String(64), nullable=True))
        batch.add_column(sa.Column("cached_from", sa.String(36), nullable=True))
    op.create_index("ix_jobs_cache_key", "jobs", ["cache_key", "state"])
    with op.batch_alter_table("plugin_prices") as batch:
        batch.add_column(sa.Column("cache_price_micro", sa.BigInteger(), nullable=False,
                                   server_default="100"))


def downgrade() -> None:
    with op.batch_alter_table("plugin_prices") as batch:
        batch.drop_column("cache_price_micro")
    op.drop_index("ix_jobs_cache_key", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        for name in ("cached_from", "cache_key", "cache", "output_format"):
            batch.drop_column(name)
