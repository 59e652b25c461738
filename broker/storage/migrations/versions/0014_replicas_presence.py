"""Broker replicas (issue #21): which replica holds each agent's stream, the replicas
themselves, and the market's measured figures (θ, reliability, canaries) in the database.

Revision ID: 0014_replicas_presence
Revises: 0014_trust_market_operator_links
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_replicas_presence"
down_revision = "0014_trust_market_operator_links"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("providers") as batch:
        batch.add_column(sa.Column("replica_id", sa.String(100), nullable=True))
        batch.create_index("ix_providers_replica_id", ["replica_id"])
    op.create_table(
        "broker_replicas",
        sa.Column("id", sa.String(100), nullable=False),
        sa.Column("public_key", sa.String(64), nullable=False),
        sa.Column("http", sa.String(200), nullable=False, server_default=""),
        sa.Column("grpc", sa.String(200), nullable=False, server_default=""),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("seen_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_broker_replicas"),
    )
    op.create_table(
        "provider_throughput",
        sa.Column("provider_id", sa.String(36), nullable=False),
        sa.Column("plugin", sa.String(64), nullable=False),
        sa.Column("claimed_units_per_s", sa.Float(), nullable=True),
        sa.Column("measured_units_per_s", sa.Float(), nullable=True),
        sa.Column("samples", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("successes", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("failures", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("last_canary_at", sa.Float(), nullable=True),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["provider_id"], ["providers.id"],
                                name="fk_provider_throughput_provider_id_providers"),
        sa.PrimaryKeyConstraint("provider_id", "plugin", name="pk_provider_throughput"),
    )


def downgrade() -> None:
    op.drop_table("provider_throughput")
    op.drop_table("broker_replicas")
    with op.batch_alter_table("providers") as batch:
        batch.drop_index("ix_providers_replica_id")
        batch.drop_column("replica_id")
