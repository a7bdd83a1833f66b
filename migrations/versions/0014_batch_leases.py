"""A batch's runner and its lease (issue 50): gateways on one database run each batch in
one of them; another takes over once the lease lapses (its gateway died)

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as t:
        t.add_column(sa.Column("runner", sa.String(length=200), nullable=True))
        t.add_column(sa.Column("lease_until", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as t:
        t.drop_column("lease_until")
        t.drop_column("runner")
