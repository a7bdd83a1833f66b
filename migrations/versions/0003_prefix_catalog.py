"""prefix catalog: the blocks each replica caches, and pinned (or published) prefixes

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "prefix_blocks",
        sa.Column("replica", sa.String(length=200), nullable=False),
        sa.Column("block_hash", sa.String(length=128), nullable=False),
        sa.Column("parent_hash", sa.String(length=128), nullable=True),
        sa.Column("tenant_id", sa.String(length=32), nullable=True),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("hits", sa.BigInteger(), nullable=False),
        sa.Column("tokens_saved", sa.BigInteger(), nullable=False),
        sa.Column("first_seen", sa.Float(), nullable=False),
        sa.Column("last_used", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("replica", "block_hash"),
    )
    op.create_index("ix_prefix_blocks_tenant_id", "prefix_blocks", ["tenant_id"])
    op.create_table(
        "pinned_prefixes",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=True),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("shared", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("created_by", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "name"),
    )


def downgrade() -> None:
    op.drop_table("pinned_prefixes")
    op.drop_index("ix_prefix_blocks_tenant_id", table_name="prefix_blocks")
    op.drop_table("prefix_blocks")
