"""The KV tiers' secret, generated once per database: the key of the MAC on every KV
block the engines store (disk, Redis) or move between workers, so that every gateway on
the database (and its engines and workers) shares it. Made here, where gateways
starting together migrate one at a time, so two never draw different ones.

Revision ID: 0012
Revises: 0011
"""

import secrets

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    settings = sa.table("server_settings", sa.column("key", sa.String), sa.column("value", sa.Text))
    op.bulk_insert(settings, [{"key": "kv_tier_secret", "value": secrets.token_hex(32)}])


def downgrade() -> None:
    op.execute("DELETE FROM server_settings WHERE key = 'kv_tier_secret'")
