"""Verification by spot redundancy (DESIGN §6): check jobs, per-job verification records,
each provider's standing (consecutive valid checks) per plugin and hardware class, and
the answers canary jobs returned.

Revision ID: 0009_verification
Revises: 0008_drop_deadline_at
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_verification"
down_revision = "0008_drop_deadline_at"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        # A check job re-runs check_of on another operator's provider; it is dispatched no
        # sooner than not_before (a random delay, so a check does not trail its job).
        batch.add_column(sa.Column("check_of", sa.String(36), nullable=True))
        batch.add_column(sa.Column("not_before", sa.Float(), nullable=True))
        batch.add_column(sa.Column("verify", sa.String(12), nullable=False,
                                   server_default="sampled"))
        # The weights a job pins (a client's pin, or a check's: the weights its run used).
        batch.add_column(sa.Column("weights_digest", sa.String(64), nullable=True))
        batch.create_index("ix_jobs_check_of", ["check_of"])
    op.create_table(
        "verifications",
        sa.Column("job_id", sa.String(36), nullable=False),
        sa.Column("plugin", sa.String(64), nullable=False),
        sa.Column("provider_id", sa.String(36), nullable=False),
        sa.Column("hardware_class", sa.String(120), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("p", sa.Float(), nullable=False),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("draw", sa.Float(), nullable=False),
        sa.Column("checker_job_id", sa.String(36), nullable=True),
        sa.Column("tiebreak_job_id", sa.String(36), nullable=True),
        sa.Column("comparisons", sa.JSON(), nullable=False),
        sa.Column("outcome", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", name="pk_verifications"),
    )
    op.create_index("ix_verifications_status_updated", "verifications", ["status", "updated_at"])
    op.create_index("ix_verifications_checker", "verifications", ["checker_job_id"])
    op.create_index("ix_verifications_tiebreak", "verifications", ["tiebreak_job_id"])
    op.create_table(
        "provider_standing",
        sa.Column("provider_id", sa.String(36), nullable=False),
        sa.Column("plugin", sa.String(64), nullable=False),
        sa.Column("hardware_class", sa.String(120), nullable=False),
        sa.Column("consecutive_valid", sa.Integer(), nullable=False),
        sa.Column("checks", sa.Integer(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("quota_factor", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("provider_id", "plugin", "hardware_class",
                                name="pk_provider_standing"),
    )


    # Canary answers (DESIGN §6): what runs of one canary input in one reproducibility class
    # returned, and which operators returned it; two operators agreeing make it known.
    op.create_table(
        "canary_answers",
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("answer", sa.String(64), nullable=False),
        sa.Column("operators", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("key", "answer", name="pk_canary_answers"),
    )


def downgrade() -> None:
    op.drop_table("canary_answers")
    op.drop_table("provider_standing")
    op.drop_index("ix_verifications_tiebreak", table_name="verifications")
    op.drop_index("ix_verifications_checker", table_name="verifications")
    op.drop_index("ix_verifications_status_updated", table_name="verifications")
    op.drop_table("verifications")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_check_of")
        batch.drop_column("weights_digest")
        batch.drop_column("verify")
        batch.drop_column("not_before")
        batch.drop_column("check_of")
