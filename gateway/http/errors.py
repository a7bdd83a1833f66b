"""Errors in the shape of the API a route belongs to: OpenAI's
`{"error": {"message", "type", "param", "code"}}`, or Anthropic's
`{"type": "error", "error": {"type", "message"}}` on the Messages routes (ANTHROPIC_PATHS),
whose SDK raises its typed errors only from that shape and its status codes, or Ollama's
`{"error": "..."}` on its native routes (OLLAMA_PATHS), whose client reads the message there."""

from __future__ import annotations

import json

from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code, self.param)

    def response(self, path: str = "") -> web.Response:
        """The error as the API of the route at `path` shapes it."""
        if is_anthropic(path):
            status, body = anthropic_error(self.status, self.message)
            headers = self.headers
            if status == 429 and not any(k.lower() == "retry-after" for k in headers):
                headers = headers | {"retry-after": "1"}  # Anthropic's clients wait on it
        elif is_ollama(path):
            status, body, headers = self.status, {"error": self.message}, self.headers
        else:
            status, body, headers = self.status, self.body(), self.headers
        return web.Response(
            status=status, body=json.dumps(body), content_type="application/json", headers=headers
        )


def error_body(status: int, message: str, code: str | None = None, param: str | None = None):
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


# path prefixes whose errors are Anthropic-shaped (the Messages API's routes)
ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


# path prefixes whose errors are Ollama-shaped (its native API's routes)
OLLAMA_PATHS = ("/api",)


def is_ollama(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in OLLAMA_PATHS)


def is_anthropic(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in ANTHROPIC_PATHS)


def anthropic_error(status: int, message: str) -> tuple[int, dict]:
    """The status and body Anthropic's API would send: kvgate's 503 (no backend, no
    usage row) is its 529 overloaded_error, a retryable status its clients know."""
    if status == 503:
        status = 529
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def error_body_for(path: str, status: int, message: str) -> tuple[int, dict]:
    """The status and body of an error on the route at `path`, in its API's shape."""
    if is_anthropic(path):
        return anthropic_error(status, message)
    if is_ollama(path):
        return status, {"error": message}
    return status, error_body(status, message)
