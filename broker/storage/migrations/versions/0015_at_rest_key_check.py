"""The at-rest key's check value (issue #21/#23): which key this database's sealed values
are sealed with, so that a replica with another key is refused at start instead of writing
what the others cannot read (broker/storage/sealed.py, ``open_at_rest``).

Revision ID: 0015_at_rest_key_check
Revises: 0014_s3_outputs
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015_at_rest_key_check"
down_revision = "0014_s3_outputs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "at_rest_key_check",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("check_value", sa.String(64), nullable=False),
        sa.Column("set_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_at_rest_key_check"),
    )


def downgrade() -> None:
    op.drop_table("at_rest_key_check")
