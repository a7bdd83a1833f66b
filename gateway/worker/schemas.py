"""Request bodies of the worker's routes, as strict as the gateway's (gateway/schemas/inference.py).

The worker's /v1/completions is the gateway's CompletionRequest narrowed to what one
engine call serves (one prompt, n = 1) plus vLLM's `cache_salt` and `priority`, which a
gateway in front sets per tenant. /tokenize and /detokenize take the gateway's own bodies
(gateway.schemas.inference). /kvgate/v1/generate takes any JSON object: the GenRequest record
decodes it, strictly, itself; /kvgate/v1/abort a request's id.
"""

from __future__ import annotations

from typing import Any

from pydantic import RootModel, field_validator

from gateway.schemas.base import StrictBody
from gateway.schemas.fields import Name, Priority
from gateway.schemas.inference import CompletionRequest, TokenizeRequest


class WorkerCompletionRequest(CompletionRequest):
    # vLLM's: salts the prefix cache (a gateway in front sends the tenant's salt)
    cache_salt: Name | None = None
    # vLLM's: lower runs first
    priority: Priority = 0

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not all(isinstance(x, int) for x in v):
            raise ValueError(
                "a worker serves one prompt per request: a string or a list of token ids"
            )
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("a worker serves n = 1 only")
        return v


class WorkerTokenizeRequest(TokenizeRequest):
    """The gateway's /tokenize body, with a chat's images (ImageInput records: their
    files, placed where its image_url parts say `kvgate:image`:
    gateway/backends/remote_images.py), counted, decoded and checked as /generate's are."""

    images: list[dict[str, Any]] | None = None


class AbortRequest(StrictBody):
    """POST /kvgate/v1/abort: the gateway's id of a request running here."""

    request_id: Name


class JsonObject(RootModel[dict[str, Any]]):
    """Any JSON object (a record's `from_dict` checks its fields)."""
