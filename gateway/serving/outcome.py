"""How a served request ends, the same for every API that streams a Job (chat
completions, completions, Anthropic's messages, OpenAI's responses): the usage row
committed before the response completes, a failure's status and the words a client may
hear, and large tool calls handled off the event loop.

`whole_answer` and `streamed` hold the rules once, and each API brings only its shapes:
a client that hangs up is billed for what it received and for the prompt its engine
computed, prefill cut short or not (a 499 row: Job.finish); a whole answer that failed
bills nothing and is the client's error; a stream that failed after its 200 bills what
went out (and the prompt computed) and ends with the API's error event, as does one the
drain cuts at its deadline (a 503 row); and an answer whose usage row is not committed
does not complete.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from gateway.backends import AdapterLoadError, BackendError, BadRequestError
from gateway.http.drain import RETRY_AFTER_S
from gateway.http.errors import ApiError
from gateway.serving.job import Job

# what a client that went away raises in its handler
CLIENT_GONE = (ConnectionResetError, asyncio.CancelledError)
# A held tool call past this many characters is parsed and encoded in a worker thread:
# on the loop, 16 MB of arguments would stall every other request for about half a second.
LARGE_CALL_CHARS = 1 << 20
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
log = logging.getLogger("kvgate")
T = TypeVar("T")
# a request still running at the drain's deadline (gateway/http/drain.py)
CUT = ApiError(
    503,
    "The server shut down before this request finished; retry it.",
    code="shutting_down",
    headers={"Retry-After": str(RETRY_AFTER_S)},
)


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


def failure(job: Job, e: Exception) -> ApiError:
    """The error a client gets for a request that failed mid-way: a backend's own
    errors as they are (they name the backend, never an upstream's words); an adapter
    that would not load is a 500 (its files, which no retry mends); anything else is
    logged and told without its text."""
    if isinstance(e, BadRequestError):
        return ApiError(400, str(e))
    if isinstance(e, AdapterLoadError):
        return ApiError(500, str(e), code=e.code)
    if isinstance(e, BackendError):
        return ApiError(503, str(e))
    log.exception("request %s failed", job.request_id)
    return ApiError(503, f"the backend of model {job.model!r} failed (request {job.request_id})")


async def finish_failed(job: Job, status: int, error: str, delivered: bool = True) -> None:
    """Record a request the backend failed; the client hears of the backend's error."""
    try:
        await job.finish(status, None, error, delivered)
    except Exception:
        log.exception("usage row of %s not committed", job.request_id)


class whole_answer:  # noqa: N801 (used as a function: `async with whole_answer(job)`)
    """Around reading a whole answer's output (nothing else: any error inside is the
    backend's): a failure is the client's error, and none of the output is billed, for
    the client receives none of it. A class, not a generator: every whole answer enters
    one (docs/PERF.md, issue 53)."""

    __slots__ = ("job", "cut")

    def __init__(self, job: Job) -> None:
        self.job = job
        self.cut = job.gw.drain.cuttable()

    async def __aenter__(self) -> None:
        self.cut.__enter__()

    async def __aexit__(self, kind: type[BaseException] | None, e: Any, tb: Any) -> None:
        self.cut.__exit__(kind, e, tb)
        if e is None:
            return
        job = self.job
        if isinstance(e, CLIENT_GONE):
            if job.gw.drain.was_cut():  # the drain's deadline: nothing went out, retry elsewhere
                await finish_failed(job, 503, CUT.message, delivered=False)
                raise CUT from None
            await job.finish(499, "abort")
            return  # raised on as it was
        if isinstance(e, Exception):
            error = failure(job, e)
            await finish_failed(job, error.status, error.message, delivered=False)
            raise error from None


# an API's error event: (the error, whether it is the usage row that failed)
ErrorEvent = Callable[[ApiError, bool], bytes]


async def streamed(
    request: web.Request,
    resp: web.StreamResponse,
    job: Job,
    produce: Callable[[], Awaitable[str | None]],
    error_event: ErrorEvent,
) -> bool:
    """Prepare `resp` and run `produce` (it writes the stream's events and returns the
    finish reason), then commit the usage row. True when the caller may write the
    stream's closing events; False when it ended with an error event instead."""
    try:
        await resp.prepare(request)
        with job.gw.drain.cuttable():
            finish = await produce()
    except CLIENT_GONE:
        if not job.gw.drain.was_cut():
            await job.finish(499, "abort")
            raise
        await finish_failed(job, CUT.status, CUT.message)  # billed for what it delivered
        await resp.write(error_event(CUT, False))
        return False
    except Exception as e:  # billed for what was streamed before it
        error = failure(job, e)
        await finish_failed(job, error.status, error.message)
        if not resp.prepared:
            raise error from None
        await resp.write(error_event(error, False))
        return False
    try:
        await finish_or_503(job, 200, finish)
    except ApiError as e:  # not complete without its usage row: no closing events
        await resp.write(error_event(e, True))
        return False
    return True
