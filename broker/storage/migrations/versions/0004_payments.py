"""Payments: providers' Stripe Connect accounts and their payouts.

Revision ID: 0004_payments
Revises: 0003_pricing
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_payments"
down_revision = "0003_pricing"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "connect_accounts",
        sa.Column("owner_id", sa.String(160), nullable=False),
        sa.Column("stripe_account_id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("owner_id", name="pk_connect_accounts"),
    )
    op.create_table(
        "payouts",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("owner_id", sa.String(160), nullable=False),
        sa.Column("amount_micro", sa.BigInteger(), nullable=False),
        sa.Column("amount_cents", sa.BigInteger(), nullable=False),
        sa.Column("currency", sa.String(8), nullable=False),
        sa.Column("destination", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("transfer_id", sa.String(64), nullable=True),
        sa.Column("reversal_transaction_id", sa.String(32), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_payouts"),
    )
    op.create_index("ix_payouts_owner_id_created_at", "payouts", ["owner_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_payouts_owner_id_created_at", "payouts")
    op.drop_table("payouts")
    op.drop_table("connect_accounts")
