"""The Files and Batch APIs (issue 50): files, batches and their lines; a usage row names
the batch and the line's custom_id it billed, unique together, so a line run again
after a crash is billed once

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_files_tenant_created", "files", ["tenant_id", "created_at"])
    times = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at")
    times += ("cancelling_at", "cancelled_at")
    op.create_table(
        "batches",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("endpoint", sa.String(length=40), nullable=False),
        sa.Column("input_file_id", sa.String(length=40), nullable=False),
        sa.Column("completion_window", sa.String(length=8), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("metadata", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        *(sa.Column(name, sa.Float(), nullable=True) for name in times),
        sa.Column("output_file_id", sa.String(length=40), nullable=True),
        sa.Column("error_file_id", sa.String(length=40), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("errors", sa.JSON(none_as_null=True), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_batches_tenant_created", "batches", ["tenant_id", "created_at"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(length=40), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(length=200), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("result", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("batch_id", "line"),
    )
    op.create_index("ix_batch_lines_state", "batch_lines", ["batch_id", "state"])
    with op.batch_alter_table("usage_records") as t:
        t.add_column(sa.Column("batch_id", sa.String(length=40), nullable=True))
        t.add_column(sa.Column("custom_id", sa.String(length=200), nullable=True))
        t.create_index("ux_usage_records_batch_line", ["batch_id", "custom_id"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as t:
        t.drop_index("ux_usage_records_batch_line")
        t.drop_column("custom_id")
        t.drop_column("batch_id")
    op.drop_table("batch_lines")
    op.drop_table("batches")
    op.drop_table("files")
