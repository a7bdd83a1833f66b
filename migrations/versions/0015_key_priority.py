"""An API key's own default priority (issue 50): a tenant's interactive and background
keys; NULL, the tenant's

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as t:
        t.add_column(sa.Column("priority", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as t:
        t.drop_column("priority")
