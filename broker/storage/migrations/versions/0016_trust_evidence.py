"""Evidence that lasts across checks (issue #20): each provider's sampled-text evidence
compounded over its checked claims per plugin and per witness, the operator whose run
gave each e-value (``sampled_text.SamplingState``: a claim
sampled from a narrower nucleus than asked reaches only the grey zone in one check, never
the reject bound, and must be caught over several), and each provider's recent canaries
per plugin, answered or not (a canary not answered within its deadline counts against it:
``broker.verification.canary_misses``). Both must survive a restart and be one record for
every replica.

Revision ID: 0016_trust_evidence
Revises: 0015_at_rest_key_check
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016_trust_evidence"
down_revision = "0015_at_rest_key_check"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sampling_evidence",
        sa.Column("provider_id", sa.String(36), nullable=False),
        sa.Column("plugin", sa.String(64), nullable=False),
        sa.Column("witness", sa.String(64), nullable=False),
        sa.Column("checks", sa.Integer(), nullable=False),
        sa.Column("log_s", sa.Float(), nullable=True),
        sa.Column("closed", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("provider_id", "plugin", "witness",
                                name="pk_sampling_evidence"),
    )
    op.create_table(
        "canary_misses",
        sa.Column("provider_id", sa.String(36), nullable=False),
        sa.Column("plugin", sa.String(64), nullable=False),
        sa.Column("recent", sa.String(64), nullable=False),
        sa.Column("missed", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("provider_id", "plugin", name="pk_canary_misses"),
    )


def downgrade() -> None:
    op.drop_table("canary_misses")
    op.drop_table("sampling_evidence")
