"""What each agent last said of its availability (idle-only mode, schedule, limits: issue
#26), kept with its provider so any replica can show it.

Revision ID: 0014_agent_availability
Revises: 0014_replicas_presence
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_agent_availability"
down_revision = "0014_replicas_presence"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("providers") as batch:
        batch.add_column(sa.Column("availability", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("providers") as batch:
        batch.drop_column("availability")
