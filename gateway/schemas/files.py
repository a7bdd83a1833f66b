"""The Files API's shapes (OpenAI's): a batch input file's lines as they are checked one
by one, the list query, and a stored file as the API answers it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from gateway.schemas.base import NO_CONTROL

# the endpoints a batch may run (OpenAI's four the gateway serves)
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages")
PURPOSES = ("batch",)  # what a client may upload; results are "batch_output"
MAX_PAGE = 10_000  # OpenAI's bound on a files page
CustomId = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=NO_CONTROL)]


class BatchInputLine(BaseModel):
    """One line of a batch input file."""

    model_config = ConfigDict(extra="forbid", strict=True)

    custom_id: CustomId
    method: Literal["POST"]
    url: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages"]
    body: dict[str, Any]


class FileListQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    purpose: Annotated[str, StringConstraints(max_length=32, pattern=NO_CONTROL)] | None = None
    after: Annotated[str, StringConstraints(max_length=40, pattern=NO_CONTROL)] | None = None
    limit: Annotated[int, Field(ge=1, le=MAX_PAGE)] = MAX_PAGE
    order: Literal["asc", "desc"] = "desc"


def file_object(row: Any) -> dict:
    """A stored file (gateway.db.batch_tables.StoredFile) as OpenAI's FileObject."""
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": int(row.created_at),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }
