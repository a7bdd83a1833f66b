"""The middleware every kvgate HTTP app runs (the gateway's and a worker's): every
failure leaves as JSON in its route's API's shape (OpenAI's; Anthropic's on
/v1/messages), a database outage as a 503 to retry, and a URL with a control character
is refused before a handler can send it to the database.
"""

from __future__ import annotations

import logging
import re

from aiohttp import web

from gateway.http.drain import DRAIN
from gateway.http.errors import ApiError, error_body_for
from gateway.http.util import json_response

log = logging.getLogger("kvgate")
DATABASE_UNAVAILABLE = ApiError(
    503,
    "The database is unavailable; the request was not served. Retry shortly.",
    code="database_unavailable",
    headers={"Retry-After": "1"},
)


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves as JSON in its route's shape, aiohttp's own (404, 405, 413)
    included."""
    try:
        return await handler(request)
    except Exception as e:
        return _error_response(request, e)


@web.middleware
async def refuse_control_characters(request: web.Request, handler) -> web.StreamResponse:
    """A path or query holding a control character (NUL above all, which PostgreSQL cannot
    store or compare) is refused before any handler sends it to the database."""
    _refuse_control_characters(request)
    return await handler(request)


@web.middleware
async def gateway_requests(request: web.Request, handler) -> web.StreamResponse:
    """The gateway's app's three, in their order and in one layer: openai_errors around
    refuse_control_characters around drain_guard. Each middleware is one more coroutine
    in every request's chain, resumed at each of its waits (docs/PERF.md, issue 53)."""
    drain, task = request.app[DRAIN], None
    try:
        _refuse_control_characters(request)
        task = drain.admit(request)
        return await handler(request)
    except Exception as e:
        return _error_response(request, e)
    finally:
        if task is not None:
            drain.running.discard(task)


def _refuse_control_characters(request: web.Request) -> None:
    if _CONTROL.search(request.path) or _CONTROL.search(request.query_string):
        raise ApiError(400, "The URL holds a control character.")


def _error_response(request: web.Request, e: Exception) -> web.StreamResponse:
    """`e` as JSON in the route's shape; an HTTPException under 400 (a redirect) is raised."""
    if isinstance(e, ApiError):
        return e.response(request.path)
    if isinstance(e, web.HTTPException):
        if e.status < 400:
            raise e
        message = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
        # keep what the exception says in headers (Allow on a 405), not its text type
        headers = {k: v for k, v in e.headers.items() if k.lower() != "content-type"}
        status, body = error_body_for(request.path, e.status, message)
        return json_response(body, status=status, headers=headers)
    # imported on this path only: a worker opens no database, and gateway.db is SQLAlchemy
    # and asyncpg, about 0.3 CPU-s of each worker's start
    from gateway.db import is_outage

    if is_outage(e):
        log.warning("database unavailable on %s %s: %s", request.method, request.path, e)
        return DATABASE_UNAVAILABLE.response(request.path)
    log.exception("unhandled error on %s %s", request.method, request.path, exc_info=e)
    status, body = error_body_for(request.path, 500, "Internal server error.")
    return json_response(body, status=status)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
