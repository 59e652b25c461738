"""Observability (issue #25): each provider's latest telemetry (GPU, CPU, memory, as its
agent last reported it in a heartbeat) and each job's request id (the X-Request-Id of the
request that created it, carried into its envelope and the agent's logs).

Revision ID: 0014_observability_telemetry
Revises: 0014_secure_key_scopes
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_observability_telemetry"
down_revision = "0014_secure_key_scopes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("providers") as batch:
        batch.add_column(sa.Column("telemetry", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("telemetry_at", sa.Float(), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("request_id", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("request_id")
    with op.batch_alter_table("providers") as batch:
        batch.drop_column("telemetry_at")
        batch.drop_column("telemetry")
