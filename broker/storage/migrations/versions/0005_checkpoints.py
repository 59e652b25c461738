"""Checkpoints: the latest checkpoint of each attempt of a job (DESIGN §2).

Revision ID: 0005_checkpoints
Revises: 0004_payments
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_checkpoints"
down_revision = "0004_payments"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_checkpoints",
        sa.Column("job_id", sa.String(36), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("provider_id", sa.String(36), nullable=False),
        sa.Column("base_step", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("rate_micro_per_unit", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_job_checkpoints_job_id_jobs"),
        sa.PrimaryKeyConstraint("job_id", "attempt", name="pk_job_checkpoints"),
    )


def downgrade() -> None:
    op.drop_table("job_checkpoints")
