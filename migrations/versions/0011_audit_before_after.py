"""The audit log holds each change's object before and after (JSON) and the tenant it
concerns, in place of one free-text detail; targets as long as an adapter's name (200)

Rows written before hold what their detail held: in `before` for a deletion (what was
deleted), in `after` for anything else (what was set).

Revision ID: 0011
Revises: 0010
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

REMOVALS = ("tenant.delete", "prefix.unpin", "adapter.delete")

audit = sa.table(
    "audit_log",
    sa.column("id", sa.Integer),
    sa.column("action", sa.String),
    sa.column("target", sa.String),
    sa.column("tenant_id", sa.String),
    sa.column("detail", sa.Text),
    sa.column("before", sa.JSON(none_as_null=True)),
    sa.column("after", sa.JSON(none_as_null=True)),
)


def upgrade() -> None:
    with op.batch_alter_table("audit_log") as b:
        b.add_column(sa.Column("tenant_id", sa.String(length=32), nullable=True))
        b.add_column(sa.Column("before", sa.JSON(), nullable=True))
        b.add_column(sa.Column("after", sa.JSON(), nullable=True))
        b.alter_column("target", type_=sa.String(length=200), existing_nullable=False)
    conn = op.get_bind()
    rows = conn.execute(sa.select(audit.c.id, audit.c.action, audit.c.target, audit.c.detail))
    for row_id, action, target, detail in rows.all():
        values = json.loads(detail) if detail else {}
        values = values if isinstance(values, dict) else {"detail": values}
        tenant = target if action.startswith("tenant.") else values.get("tenant_id")
        side = "before" if action in REMOVALS else "after"
        conn.execute(
            audit.update().where(audit.c.id == row_id).values({side: values, "tenant_id": tenant})
        )
    with op.batch_alter_table("audit_log") as b:
        b.drop_column("detail")
        b.create_index("ix_audit_log_ts", ["ts"])
        b.create_index("ix_audit_log_tenant_id", ["tenant_id"])


def downgrade() -> None:
    with op.batch_alter_table("audit_log") as b:
        b.add_column(sa.Column("detail", sa.Text(), nullable=False, server_default=""))
    conn = op.get_bind()
    rows = conn.execute(sa.select(audit.c.id, audit.c.before, audit.c.after))
    for row_id, before, after in rows.all():
        detail = json.dumps(after if after is not None else before or {})
        conn.execute(audit.update().where(audit.c.id == row_id).values(detail=detail))
    with op.batch_alter_table("audit_log") as b:
        b.drop_index("ix_audit_log_tenant_id")
        b.drop_index("ix_audit_log_ts")
        b.drop_column("after")
        b.drop_column("before")
        b.drop_column("tenant_id")
        b.alter_column("target", type_=sa.String(length=64), existing_nullable=False)
        b.alter_column("detail", server_default=None)
