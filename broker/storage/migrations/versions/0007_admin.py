"""Admin console: the hash-chained audit log, disputes, plugin policies (minimum stake,
always-verify threshold) and revoked console sessions.

Revision ID: 0007_admin
Revises: 0006_auction
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_admin"
down_revision = "0006_auction"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column("seq", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False,
                  autoincrement=False),
        sa.Column("at_ms", sa.BigInteger(), nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("subject", sa.String(200), nullable=False),
        sa.Column("data", sa.Text(), nullable=False),
        sa.Column("ref", sa.String(200), nullable=True),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("seq", name="pk_audit_log"),
        sa.UniqueConstraint("ref", name="uq_audit_log_ref"),
    )
    op.create_index("ix_audit_log_subject_seq", "audit_log", ["subject", "seq"])
    op.create_table(
        "disputes",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("job_id", sa.String(36), nullable=False),
        sa.Column("plugin", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("opened_at", sa.Float(), nullable=False),
        sa.Column("outcome", sa.Text(), nullable=False),
        sa.Column("sides", sa.JSON(), nullable=False),
        sa.Column("comparisons", sa.JSON(), nullable=False),
        sa.Column("resolution", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_disputes"),
    )
    op.create_index("ix_disputes_job_id", "disputes", ["job_id"])
    op.create_index("ix_disputes_state_opened_at", "disputes", ["state", "opened_at"])
    op.create_table(
        "plugin_policies",
        sa.Column("plugin", sa.String(64), nullable=False),
        sa.Column("min_stake_micro", sa.BigInteger(), nullable=False),
        sa.Column("always_verify_above_micro", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("updated_by", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("plugin", name="pk_plugin_policies"),
    )
    op.create_table(
        "admin_session_revocations",
        sa.Column("jti", sa.String(64), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("jti", name="pk_admin_session_revocations"),
    )


def downgrade() -> None:
    op.drop_table("admin_session_revocations")
    op.drop_table("plugin_policies")
    op.drop_index("ix_disputes_state_opened_at", "disputes")
    op.drop_index("ix_disputes_job_id", "disputes")
    op.drop_table("disputes")
    op.drop_index("ix_audit_log_subject_seq", "audit_log")
    op.drop_table("audit_log")
