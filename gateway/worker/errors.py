"""Engine errors as HTTP errors, in the shape the `remote` adapter turns back into them:
400 for BadRequestError, 503 for BackendError, and for PromptTooLongError and
AdapterLoadError what they were raised with, so that the gateway rebuilds the same
error on its side."""

from __future__ import annotations

from typing import Any

from engine_api.errors import AdapterLoadError, BackendError, BadRequestError, PromptTooLongError
from gateway.http.errors import ApiError


class ContextLengthError(ApiError):
    """400 `context_length_exceeded`, with `prompt_tokens`, `max_tokens` and
    `context_length` beside the usual error fields."""

    def __init__(self, e: PromptTooLongError) -> None:
        super().__init__(400, str(e), code="context_length_exceeded", param="prompt_token_ids")
        self.fields = {
            "prompt_tokens": e.prompt_tokens,
            "max_tokens": e.max_tokens,
            "context_length": e.context_length,
        }

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"].update(self.fields)
        return body


class AdapterLoadFailed(ApiError):
    """500 `adapter_load_failed`, with the adapter's name and the engine's reason (the
    gateway's registry shows it to the operator)."""

    def __init__(self, e: AdapterLoadError) -> None:
        super().__init__(500, str(e), code=e.code)
        self.fields = {"adapter": e.adapter, "reason": e.reason}

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"].update(self.fields)
        return body


def api_error(e: BadRequestError | BackendError) -> ApiError:
    if isinstance(e, PromptTooLongError):
        return ContextLengthError(e)
    if isinstance(e, AdapterLoadError):
        return AdapterLoadFailed(e)
    if isinstance(e, BadRequestError):
        return ApiError(400, str(e))
    return ApiError(503, str(e), code="backend_unavailable")
