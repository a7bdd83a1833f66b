"""spend in money: each usage row and daily total holds what it cost (nanodollars, 0 for
the rows before prices), and tenants and keys may have daily and monthly money budgets

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

BUDGETS = ("daily_spend", "monthly_spend")


def upgrade() -> None:
    for table in ("usage_records", "daily_usage"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(
                sa.Column("spend_nano_usd", sa.BigInteger(), server_default="0", nullable=False)
            )
    for table in ("quotas", "api_keys"):
        with op.batch_alter_table(table) as batch:
            for name in BUDGETS:
                batch.add_column(sa.Column(name, sa.BigInteger(), nullable=True))


def downgrade() -> None:
    for table in ("quotas", "api_keys"):
        with op.batch_alter_table(table) as batch:
            for name in reversed(BUDGETS):
                batch.drop_column(name)
    for table in ("usage_records", "daily_usage"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("spend_nano_usd")
