"""Drop two counters of 0016 that nothing reads: ``sampling_evidence.closed`` (a slash now
deletes the provider's rows; the ``verification.sampling_closed`` audit entry records each
close) and ``canary_misses.missed`` (the window in ``recent`` is what the rule reads; the
audit entries count every canary unanswered).

Revision ID: 0017_trust_evidence_unread
Revises: 0016_trust_evidence
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017_trust_evidence_unread"
down_revision = "0016_trust_evidence"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sampling_evidence") as batch:
        batch.drop_column("closed")
    with op.batch_alter_table("canary_misses") as batch:
        batch.drop_column("missed")


def downgrade() -> None:
    with op.batch_alter_table("canary_misses") as batch:
        batch.add_column(sa.Column("missed", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("sampling_evidence") as batch:
        batch.add_column(sa.Column("closed", sa.Integer(), nullable=False, server_default="0"))
