"""Standing asks and admin-set market rules outlive the broker process (DESIGN §4).

Revision ID: 0011_standing_asks
Revises: 0010_registry
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_standing_asks"
down_revision = "0010_registry"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "standing_asks",
        sa.Column("provider_id", sa.String(36), nullable=False),
        sa.Column("plugin", sa.String(64), nullable=False),
        sa.Column("price_micro_per_unit", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["provider_id"], ["providers.id"],
                                name="fk_standing_asks_provider_id_providers"),
        sa.PrimaryKeyConstraint("provider_id", "plugin", name="pk_standing_asks"),
    )
    op.create_table(
        "market_rules",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("updated_by", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_market_rules"),
    )


def downgrade() -> None:
    op.drop_table("market_rules")
    op.drop_table("standing_asks")
