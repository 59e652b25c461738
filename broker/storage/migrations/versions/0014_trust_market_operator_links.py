"""Operator links (issue #20): the signals the broker saw of each account (payout account,
Stripe customer, network prefix, hardware fingerprint, a reused agent key, an admin's
word), hashed; two accounts sharing one are linked.

Revision ID: 0014_trust_market_operator_links
Revises: 0013_hold_other_royalties
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_trust_market_operator_links"
down_revision = "0013_hold_other_royalties"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "operator_signals",
        sa.Column("account_id", sa.String(36), primary_key=True),
        sa.Column("kind", sa.String(32), primary_key=True),
        sa.Column("value_sha256", sa.String(64), primary_key=True),
        sa.Column("label", sa.String(200), nullable=False),
        sa.Column("first_seen_at", sa.Float(), nullable=False),
        sa.Column("last_seen_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_operator_signals_value", "operator_signals", ["kind", "value_sha256"])


def downgrade() -> None:
    op.drop_index("ix_operator_signals_value", table_name="operator_signals")
    op.drop_table("operator_signals")
