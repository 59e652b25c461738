"""Drop jobs.deadline_at: the spine's placeholder, never written; the deadline a client
sets is jobs.deadline_s (relative to created_at), added with the market.

Revision ID: 0008_drop_deadline_at
Revises: 0007_admin
"""
import sqlalchemy as sa
from alembic import op

revision = "0008_drop_deadline_at"
down_revision = "0007_admin"
branch_labels = None
depends_on = None


def upgrade():
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("deadline_at")


def downgrade():
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("deadline_at", sa.Float(), nullable=True))
