"""Pricing: admin-set prices per plugin; each job records its ledger hold and maximum price.

Revision ID: 0003_pricing
Revises: 0002_ledger
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_pricing"
down_revision = "0002_ledger"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "plugin_prices",
        sa.Column("plugin", sa.String(64), nullable=False),
        sa.Column("reserve_micro_per_unit", sa.BigInteger(), nullable=False),
        sa.Column("fee_bps", sa.Integer(), nullable=False),
        sa.Column("min_charge_micro", sa.BigInteger(), nullable=False),
        sa.Column("vesting_window_s", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("updated_by", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("plugin", name="pk_plugin_prices"),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("hold_id", sa.String(32), nullable=True))
        batch.add_column(sa.Column("max_price_micro", sa.BigInteger(), nullable=False,
                                   server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("max_price_micro")
        batch.drop_column("hold_id")
    op.drop_table("plugin_prices")
