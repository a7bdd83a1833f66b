"""usage rows say who counted their tokens: the engine, or the gateway for an upstream
that sent no usage

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.add_column(
            sa.Column("counted_by", sa.String(length=16), server_default="engine", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("counted_by")
