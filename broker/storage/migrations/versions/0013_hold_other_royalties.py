"""A posted hold records every publisher's royalty: ``other_royalties`` holds those beyond
``publisher_id``'s (a job using adapters of several publishers pays each of them).

Revision ID: 0013_hold_other_royalties
Revises: 0012_verification_sweep
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_hold_other_royalties"
down_revision = "0012_verification_sweep"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ledger_holds") as batch:
        batch.add_column(sa.Column("other_royalties", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ledger_holds") as batch:
        batch.drop_column("other_royalties")
