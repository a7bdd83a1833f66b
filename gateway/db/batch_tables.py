"""The Files and Batch APIs' tables (gateway/batches): a file's metadata (its bytes are
in the gateway's files directory, named by the id), a batch, and each of its lines with
what it answered. A line's state is the batch's durable progress: a restarted gateway
runs every line not yet answered, and nothing else."""

from __future__ import annotations

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db.tables import Base


class StoredFile(Base):
    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(255))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[float] = mapped_column(Float)

    __table_args__ = (Index("ix_files_tenant_created", "tenant_id", "created_at"),)


class Batch(Base):
    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    key_id: Mapped[str] = mapped_column(String(32))  # whose limits and models its lines use
    endpoint: Mapped[str] = mapped_column(String(40))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(8))
    status: Mapped[str] = mapped_column(String(16))
    batch_metadata: Mapped[dict | None] = mapped_column("metadata", JSON(none_as_null=True))
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)
    in_progress_at: Mapped[float | None] = mapped_column(Float)
    finalizing_at: Mapped[float | None] = mapped_column(Float)
    completed_at: Mapped[float | None] = mapped_column(Float)
    failed_at: Mapped[float | None] = mapped_column(Float)
    expired_at: Mapped[float | None] = mapped_column(Float)
    cancelling_at: Mapped[float | None] = mapped_column(Float)
    cancelled_at: Mapped[float | None] = mapped_column(Float)
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    # why the whole batch failed (OpenAI's `errors.data`), or why its rest was stopped
    errors: Mapped[list | None] = mapped_column(JSON(none_as_null=True))
    # the gateway whose runner serves it (its `instance`), until when: gateways on one
    # database run each batch in one of them, and another takes over a lapsed lease
    runner: Mapped[str | None] = mapped_column(String(200))
    lease_until: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (Index("ix_batches_tenant_created", "tenant_id", "created_at"),)


class BatchLine(Base):
    __tablename__ = "batch_lines"

    batch_id: Mapped[str] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    line: Mapped[int] = mapped_column(Integer, primary_key=True)  # 0-based, the file's order
    custom_id: Mapped[str] = mapped_column(String(200))
    body: Mapped[str] = mapped_column(Text)  # the request's JSON
    # pending (not answered: run at the next chance), done (an answer, 2xx), failed
    # (an error answer), expired or cancelled (never run, never billed)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    result: Mapped[str | None] = mapped_column(Text)  # its output or error file's line

    __table_args__ = (Index("ix_batch_lines_state", "batch_id", "state"),)
