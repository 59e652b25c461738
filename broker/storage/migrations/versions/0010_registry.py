"""Plugin and adapter registry (issue #3 marketplace, #5 royalties): publisher signing
keys, immutable signed package versions and their files in the blob store.

Revision ID: 0010_registry
Revises: 0009_verification
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_registry"
down_revision = "0009_verification"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "publisher_keys",
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("account_id", sa.String(36), nullable=False),
        sa.Column("public_key", sa.String(64), nullable=False),
        sa.Column("label", sa.String(200), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("key_id", name="pk_publisher_keys"),
        sa.UniqueConstraint("public_key", name="uq_publisher_keys_public_key"),
    )
    op.create_index("ix_publisher_keys_account_id", "publisher_keys", ["account_id"])
    op.create_table(
        "registry_packages",
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("publisher_account", sa.String(36), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("document", sa.Text(), nullable=False),
        sa.Column("signature", sa.String(128), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("base_plugin", sa.String(64), nullable=True),
        sa.Column("royalty_micro", sa.BigInteger(), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("published_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("kind", "name", "version", name="pk_registry_packages"),
    )
    op.create_index("ix_registry_packages_base_plugin", "registry_packages",
                    ["kind", "base_plugin"])
    op.create_table(
        "registry_files",
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("path", sa.String(400), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("blob_key", sa.String(400), nullable=False),
        sa.PrimaryKeyConstraint("kind", "name", "version", "path", name="pk_registry_files"),
    )


def downgrade() -> None:
    op.drop_table("registry_files")
    op.drop_index("ix_registry_packages_base_plugin", "registry_packages")
    op.drop_table("registry_packages")
    op.drop_index("ix_publisher_keys_account_id", "publisher_keys")
    op.drop_table("publisher_keys")
