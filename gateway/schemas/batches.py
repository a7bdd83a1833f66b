"""The Batch API's shapes (OpenAI's): the create body, the list query, and a batch as the
API answers it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from gateway.schemas.base import NO_CONTROL, StrictBody

MAX_METADATA_KEYS = 16  # OpenAI's bounds on metadata
NO_NUL = r"^[^\x00]*$"  # PostgreSQL stores no NUL
MetadataKey = Annotated[str, StringConstraints(max_length=64, pattern=NO_NUL)]
MetadataValue = Annotated[str, StringConstraints(max_length=512, pattern=NO_NUL)]
FileId = Annotated[str, StringConstraints(min_length=1, max_length=40, pattern=NO_CONTROL)]
TIMES = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


class BatchCreate(StrictBody):
    input_file_id: FileId
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages"]
    completion_window: Literal["24h"]
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA_KEYS)] = {}


class BatchListQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    after: Annotated[str, StringConstraints(max_length=40, pattern=NO_CONTROL)] | None = None
    limit: Annotated[int, Field(ge=1, le=100)] = 20


def batch_object(row: Any) -> dict:
    """A batch (gateway.db.batch_tables.Batch) as OpenAI's Batch."""
    errors = None
    if row.errors:
        errors = {"object": "list", "data": row.errors}
    return {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "errors": errors,
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "created_at": int(row.created_at),
        "expires_at": int(row.expires_at),
        **{t: None if getattr(row, t) is None else int(getattr(row, t)) for t in TIMES},
        "request_counts": {"total": row.total, "completed": row.completed, "failed": row.failed},
        "metadata": row.batch_metadata or None,
    }
