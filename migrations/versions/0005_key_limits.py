"""API keys get limits of their own (the tenant's fields; NULL: none), and the auth epoch
that every key and tenant change rewrites, so running gateways drop their cached keys

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

LIMITS = (
    ("rpm", sa.Integer()),
    ("tpm", sa.BigInteger()),
    ("max_concurrent", sa.Integer()),
    ("daily_tokens", sa.BigInteger()),
    ("monthly_tokens", sa.BigInteger()),
    ("models", sa.JSON()),
)


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        for name, kind in LIMITS:
            batch.add_column(sa.Column(name, kind, nullable=True))
    settings = sa.table("server_settings", sa.column("key", sa.String), sa.column("value", sa.Text))
    op.bulk_insert(settings, [{"key": "auth_epoch", "value": "0"}])


def downgrade() -> None:
    op.execute("DELETE FROM server_settings WHERE key = 'auth_epoch'")
    with op.batch_alter_table("api_keys") as batch:
        for name, _ in reversed(LIMITS):
            batch.drop_column(name)
