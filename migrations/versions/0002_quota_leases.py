"""quota leases: concurrency slots per gateway instance

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "quota_leases",
        sa.Column("instance_id", sa.String(length=32), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("held", sa.Integer(), nullable=False),
        sa.Column("heartbeat", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("instance_id", "tenant_id"),
    )
    op.create_index("ix_quota_leases_heartbeat", "quota_leases", ["heartbeat"])


def downgrade() -> None:
    op.drop_index("ix_quota_leases_heartbeat", table_name="quota_leases")
    op.drop_table("quota_leases")
