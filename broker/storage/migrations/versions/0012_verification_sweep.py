"""The verification sweep's look-up of settled jobs without a sampling draw filters on
state and finished_at: an index on (state, finished_at) serves it (DESIGN §6).

Revision ID: 0012_verification_sweep
Revises: 0011_standing_asks
"""
from __future__ import annotations

from alembic import op

revision = "0012_verification_sweep"
down_revision = "0011_standing_asks"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_state_finished", "jobs", ["state", "finished_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_state_finished", table_name="jobs")
