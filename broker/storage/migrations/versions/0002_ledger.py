"""Ledger: accounts with cached balances, append-only transactions and entries, holds,
idempotency records (DESIGN §5). Mirrors broker/storage/ledger_sql.py; a unit test checks
that this upgrade produces exactly the models' schema.

Revision ID: 0002_ledger
Revises: 0001_spine
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_ledger"
down_revision = "0001_spine"
branch_labels = None
depends_on = None

_TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "ledger_accounts",
        sa.Column("id", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("owner_id", sa.String(160), nullable=False),
        sa.Column("allow_negative", sa.Boolean(), nullable=False),
        sa.Column("balance_micro", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_ledger_accounts"),
        sa.CheckConstraint("allow_negative OR balance_micro >= 0",
                           name="ck_ledger_accounts_non_negative"),
    )
    op.create_index("ix_ledger_accounts_owner_id", "ledger_accounts", ["owner_id"])

    op.create_table(
        "ledger_transactions",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("kind", sa.String(20), nullable=False),
        sa.Column("created_at", _TZ, nullable=False),
        sa.Column("memo", sa.Text(), nullable=False),
        sa.Column("idempotency_key", sa.String(200), nullable=True),
        sa.Column("hold_id", sa.String(32), nullable=True),
        sa.Column("reverses_id", sa.String(32), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_ledger_transactions"),
        sa.UniqueConstraint("reverses_id", name="uq_ledger_transactions_reverses_id"),
        sa.ForeignKeyConstraint(["reverses_id"], ["ledger_transactions.id"],
                                name="fk_ledger_transactions_reverses_id_ledger_transactions"),
    )
    op.create_index("ix_ledger_transactions_hold_id", "ledger_transactions", ["hold_id"])

    op.create_table(
        "ledger_entries",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                  autoincrement=True, nullable=False),
        sa.Column("transaction_id", sa.String(32), nullable=False),
        sa.Column("account_id", sa.String(200), nullable=False),
        sa.Column("amount_micro", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_ledger_entries"),
        sa.CheckConstraint("amount_micro <> 0", name="ck_ledger_entries_nonzero"),
        sa.ForeignKeyConstraint(["transaction_id"], ["ledger_transactions.id"],
                                name="fk_ledger_entries_transaction_id_ledger_transactions"),
        sa.ForeignKeyConstraint(["account_id"], ["ledger_accounts.id"],
                                name="fk_ledger_entries_account_id_ledger_accounts"),
    )
    op.create_index("ix_ledger_entries_account_id_id", "ledger_entries", ["account_id", "id"])
    op.create_index("ix_ledger_entries_transaction_id", "ledger_entries", ["transaction_id"])

    op.create_table(
        "ledger_holds",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("client_id", sa.String(160), nullable=False),
        sa.Column("job_id", sa.String(160), nullable=False),
        sa.Column("amount_micro", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(10), nullable=False),
        sa.Column("created_at", _TZ, nullable=False),
        sa.Column("expires_at", _TZ, nullable=False),
        sa.Column("hold_transaction_id", sa.String(32), nullable=False),
        sa.Column("resolved_at", _TZ, nullable=True),
        sa.Column("resolve_transaction_id", sa.String(32), nullable=True),
        sa.Column("captured_micro", sa.BigInteger(), nullable=False),
        sa.Column("released_micro", sa.BigInteger(), nullable=False),
        sa.Column("provider_id", sa.String(160), nullable=True),
        sa.Column("provider_micro", sa.BigInteger(), nullable=False),
        sa.Column("publisher_id", sa.String(160), nullable=True),
        sa.Column("royalty_micro", sa.BigInteger(), nullable=False),
        sa.Column("fee_micro", sa.BigInteger(), nullable=False),
        sa.Column("vests_at", _TZ, nullable=True),
        sa.Column("vest_transaction_id", sa.String(32), nullable=True),
        sa.Column("refund_transaction_id", sa.String(32), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_ledger_holds"),
        sa.CheckConstraint("amount_micro > 0", name="ck_ledger_holds_positive"),
        sa.CheckConstraint("captured_micro + released_micro <= amount_micro",
                           name="ck_ledger_holds_conserved"),
    )
    op.create_index("ix_ledger_holds_state_expires_at", "ledger_holds", ["state", "expires_at"])
    op.create_index("ix_ledger_holds_provider_id_vests_at", "ledger_holds", ["provider_id", "vests_at"])
    op.create_index("ix_ledger_holds_job_id", "ledger_holds", ["job_id"])

    op.create_table(
        "ledger_idempotency",
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("operation", sa.String(30), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("result_type", sa.String(12), nullable=False),
        sa.Column("result_id", sa.String(32), nullable=False),
        sa.Column("created_at", _TZ, nullable=False),
        sa.PrimaryKeyConstraint("key", name="pk_ledger_idempotency"),
    )


def downgrade() -> None:
    op.drop_table("ledger_idempotency")
    op.drop_table("ledger_holds")
    op.drop_index("ix_ledger_entries_transaction_id", table_name="ledger_entries")
    op.drop_index("ix_ledger_entries_account_id_id", table_name="ledger_entries")
    op.drop_table("ledger_entries")
    op.drop_index("ix_ledger_transactions_hold_id", table_name="ledger_transactions")
    op.drop_table("ledger_transactions")
    op.drop_index("ix_ledger_accounts_owner_id", table_name="ledger_accounts")
    op.drop_table("ledger_accounts")
