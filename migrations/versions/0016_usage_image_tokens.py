"""image tokens in usage (issue 52): each usage row and daily total holds how many of its
prompt tokens came from images (0 for the rows before it)

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

KINDS = {"usage_records": sa.Integer(), "daily_usage": sa.BigInteger()}


def upgrade() -> None:
    for table, kind in KINDS.items():
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("image_tokens", kind, server_default="0", nullable=False))


def downgrade() -> None:
    for table in KINDS:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("image_tokens")
