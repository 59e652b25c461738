"""The auction: priority, deadline, clearing price and split batches on jobs.

Revision ID: 0006_auction
Revises: 0005_checkpoints
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_auction"
down_revision = "0005_checkpoints"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("priority", sa.String(16), nullable=False,
                                   server_default="standard"))
        batch.add_column(sa.Column("deadline_s", sa.Float(), nullable=True))
        batch.add_column(sa.Column("price_micro_per_unit", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("batch_id", sa.String(36), nullable=True))
        batch.add_column(sa.Column("batch_index", sa.Integer(), nullable=False,
                                   server_default="0"))
    op.create_index("ix_jobs_batch_id", "jobs", ["batch_id"])


def downgrade() -> None:
    op.drop_index("ix_jobs_batch_id", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        for name in ("batch_index", "batch_id", "price_micro_per_unit", "deadline_s", "priority"):
            batch.drop_column(name)
