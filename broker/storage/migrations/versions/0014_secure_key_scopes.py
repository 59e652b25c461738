"""API keys get scopes, an expiry and a name (broker/auth/scopes.py); ``revoked_at`` may lie
in the future for a rotated key's grace period.

Revision ID: 0014_secure_key_scopes
Revises: 0014_agent_availability
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_secure_key_scopes"
down_revision = "0014_agent_availability"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("scopes", sa.String(400), nullable=False, server_default=""))
        batch.add_column(sa.Column("expires_at", sa.Float(), nullable=True))
        batch.add_column(sa.Column("name", sa.String(200), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("name")
        batch.drop_column("expires_at")
        batch.drop_column("scopes")
