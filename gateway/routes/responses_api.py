"""POST /v1/responses: OpenAI's Responses API, stateless, on the chat completion path.

The body becomes a chat completion request (gateway.schemas.responses_api) and is admitted,
served and billed as one (gateway.serving.admission, job, outcome), by the chat route's
rules: a client that hangs up is billed for what it received, a whole answer that failed
bills nothing, and an answer whose usage row is not committed does not complete (a
whole one is a 503, a stream ends with `response.failed`, never `response.completed`).
Only the shapes differ: output items instead of choices, and semantic stream events
(gateway.serving.responses_events).
"""

from __future__ import annotations

from aiohttp import web

from gateway.http.errors import ApiError
from gateway.http.util import json_response, off_loop_if, parse_body
from gateway.schemas.responses_api import ResponseCreateRequest
from gateway.serving.admission import prepare
from gateway.serving.job import Job
from gateway.serving.outcome import (
    LARGE_CALL_CHARS,
    SSE_HEADERS,
    finish_or_503,
    streamed,
    whole_answer,
)
from gateway.serving.parsed_output import Whole, choice_outputs, reasoning_tokens
from gateway.serving.responses_events import (
    ResponseEvents,
    output_items,
    response_object,
    status_of,
    usage_body,
)
from gateway.state import GW


async def create_response(request: web.Request) -> web.StreamResponse:
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    body = await parse_body(request, ResponseCreateRequest)
    # the Response's id names its usage row and x-request-id too
    job = await prepare(gw, principal, body.chat(), chat=True, id_prefix="resp_")
    if body.stream:
        return await _stream(request, job, body)
    return await _whole(job, body)


async def _whole(job: Job, body: ResponseCreateRequest) -> web.Response:
    [output], whole = choice_outputs(job, whole=True), Whole()
    finish: str | None = None
    async with whole_answer(job):
        async for _, chunk in job.events():
            output.take(chunk)
            finish = chunk.finish_reason or finish
    large = output.chars > LARGE_CALL_CHARS
    rest, finish = await off_loop_if(large, output.finish, finish)
    whole.add(rest)
    await finish_or_503(job, 200, finish)
    calls = whole.tool_calls()
    content: str | None = whole.text()
    if calls:  # the space around a call is not an answer
        content = content.strip() or None  # type: ignore[union-attr]
    answer = response_object(
        job.request_id,
        job.created,
        job.model,
        body.echoed(),
        status_of(finish),
        output_items(whole.thought(), content, calls, finish),
        usage_body(job, reasoning_tokens([output], job.completion_tokens)),
        finish,
    )
    return await off_loop_if(large, json_response, answer, 200, job.headers())


async def _stream(
    request: web.Request, job: Job, body: ResponseCreateRequest
) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS | job.headers())
    events = ResponseEvents(job.request_id, job.created, job.model, body.echoed())
    [output] = choice_outputs(job)
    last_finish: str | None = None

    async def produce() -> str | None:
        nonlocal last_finish
        await resp.write(events.start())
        async for _, chunk in job.events():
            piece = output.feed(chunk)
            finish = chunk.finish_reason
            large = output.chars > LARGE_CALL_CHARS
            if finish:
                rest, finish = await off_loop_if(large, output.finish, finish)
                piece.extend(rest)
            last_finish = finish or last_finish
            big = large and piece.chars() > LARGE_CALL_CHARS
            await resp.write(await off_loop_if(big, events.delta, piece))
        return last_finish

    def failed(error: ApiError, usage_lost: bool) -> bytes:
        """`response.failed`, never `response.completed`: a failure after the 200, or an
        answer whose usage row is not committed."""
        return events.failed("server_error" if usage_lost else _code(error.status), error.message)

    if await streamed(request, resp, job, produce, failed):
        large = events.chars > LARGE_CALL_CHARS
        usage = usage_body(job, reasoning_tokens([output], job.completion_tokens))
        last = await off_loop_if(large, events.finish, last_finish, usage)
        await resp.write(last)
        await resp.write_eof()
    return resp


def _code(status: int) -> str:
    """A failure's `error.code` in OpenAI's words for a Response."""
    return "invalid_prompt" if status == 400 else "server_error"


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
