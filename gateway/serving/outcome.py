"""How a served request ends, the same for every API that streams a Job (chat
completions, completions, Anthropic's messages, OpenAI's responses): the usage row
committed before the response completes, a failure's status and the words a client may
hear, and large tool calls handled off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from gateway.backends import BackendError, BadRequestError
from gateway.http.errors import ApiError
from gateway.serving.job import Job

# what a client that went away raises in its handler
CLIENT_GONE = (ConnectionResetError, asyncio.CancelledError)
# A held tool call past this many characters is parsed and encoded in a worker thread:
# on the loop, 16 MB of arguments would stall every other request for about half a second.
LARGE_CALL_CHARS = 1 << 20
log = logging.getLogger("kvgate")
T = TypeVar("T")


async def finish_or_503(job: Job, status: int, finish_reason: str | None) -> None:
    try:
        await job.finish(status, finish_reason)
    except Exception:  # the row could not be committed: the response must not complete
        # The database's words stay in the log: they may name other tenants' rows.
        log.exception("usage row of %s not committed", job.request_id)
        raise ApiError(
            503,
            f"Usage could not be recorded, so request {job.request_id} was not completed. "
            "Please retry.",
            code="usage_unavailable",
        ) from None


async def off_loop_if(large: bool, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, in a worker thread when the work is large."""
    return await asyncio.to_thread(fn, *args) if large else fn(*args)


def failure(job: Job, e: Exception) -> tuple[int, str]:
    """The status and message a client gets for a request that failed mid-way: a
    backend's own errors as they are (they name the backend, never an upstream's words);
    anything else is logged and told without its text."""
    if isinstance(e, BadRequestError):
        return 400, str(e)
    if isinstance(e, BackendError):
        return 503, str(e)
    log.exception("request %s failed", job.request_id)
    return 503, f"the backend of model {job.model!r} failed (request {job.request_id})"


async def finish_failed(job: Job, status: int, error: str, delivered: bool = True) -> None:
    """Record a request the backend failed; the client hears of the backend's error."""
    try:
        await job.finish(status, None, error, delivered)
    except Exception:
        log.exception("usage row of %s not committed", job.request_id)
