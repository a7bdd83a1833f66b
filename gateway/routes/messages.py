"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, for the
clients (coding agents above all) that speak it.

A Messages body is translated into the chat completion it means
(gateway.schemas.messages) and served as one: admitted, metered, limited and billed by
the same Job as /v1/chat/completions, on every backend, and ended by the same rules
(gateway.serving.outcome): a client that hangs up is billed for what it received, a
whole reply that failed bills nothing, and a reply whose usage row is not committed
does not complete. Errors on these routes are Anthropic-shaped (gateway.http.errors).
/count_tokens renders the prompt on a replica, like /tokenize: not billed, but a request of
the tenant's rpm all the same (gateway.serving.counted).
"""

from __future__ import annotations

from aiohttp import web

from gateway.http.errors import ApiError, anthropic_error
from gateway.http.util import json_response, off_loop_if, parse_body
from gateway.schemas.messages import CountTokensRequest, MessagesRequest
from gateway.serving import messages_stream as ms
from gateway.serving.admission import prepare
from gateway.serving.counted import counted
from gateway.serving.job import Job
from gateway.serving.model_access import model_card
from gateway.serving.outcome import (
    LARGE_CALL_CHARS,
    SSE_HEADERS,
    finish_or_503,
    streamed,
    whole_answer,
)
from gateway.serving.parsed_output import Whole, choice_outputs
from gateway.serving.rendering import rendered_tokens
from gateway.state import GW


async def create_message(request: web.Request) -> web.StreamResponse:
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    body = await parse_body(request, MessagesRequest)
    job = await prepare(gw, principal, body.chat, chat=True, id_prefix="msg_")
    if body.stream:
        return await _stream(request, job)
    return await _whole(job)


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as the model's template renders the messages, system and
    tools; not billed (as /tokenize is not), counted against the rpm (as it is)."""
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    async with counted(gw, principal) as headers:
        body = await parse_body(request, CountTokensRequest)
        model_card(gw, principal, body.model)
        chat = body.chat
        messages = [m.as_dict() for m in chat.messages]
        tools = None
        if chat.tool_mode != "none":  # as admission renders them: tool_choice none shows none
            tools = [t.model_dump(exclude_none=True) for t in chat.tools or []]
        tokens = await rendered_tokens(gw, principal, body.model, messages, tools)
    return json_response({"input_tokens": len(tokens)}, headers=headers)


async def _whole(job: Job) -> web.Response:
    [output], whole = choice_outputs(job, whole=True), Whole()
    finish = stop_sequence = None
    async with whole_answer(job):
        async for _, chunk in job.events():
            output.take(chunk)
            if chunk.finish_reason:
                finish, stop_sequence = chunk.finish_reason, chunk.stop_sequence
    rest, finish = await off_loop_if(output.chars > LARGE_CALL_CHARS, output.finish, finish)
    whole.add(rest)
    content, _ = await off_loop_if(output.chars > LARGE_CALL_CHARS, ms.reply_content, whole)
    await finish_or_503(job, 200, finish)
    body = ms.message(job, content, ms.stop_of(job, finish, stop_sequence))
    return json_response(body, headers=job.headers())


async def _stream(request: web.Request, job: Job) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS | job.headers())
    events = ms.MessageEvents(choice_outputs(job)[0])
    finish = stop_sequence = None

    async def produce() -> str | None:
        nonlocal finish, stop_sequence
        start = ms.message(job, [], (None, None))
        start["usage"] |= {"input_tokens": job.prompt_tokens, "output_tokens": 0}
        await resp.write(ms.event("message_start", {"type": "message_start", "message": start}))
        await resp.write(ms.event("ping", {"type": "ping"}))
        async for item in ms.with_pings(job.events(), ms.PING_EVERY_S):
            if item is None:
                await resp.write(ms.event("ping", {"type": "ping"}))
                continue
            chunk = item[1]
            out = events.feed(chunk)
            large = events.output.chars > LARGE_CALL_CHARS
            if chunk.finish_reason:
                stop_sequence = chunk.stop_sequence
                more, finish = await off_loop_if(large, events.finish, chunk.finish_reason)
                out += more
            big = large and events.fed_chars > LARGE_CALL_CHARS
            await resp.write(await off_loop_if(big, _events, out))
        return finish

    # without its usage row the reply is not complete: no message_stop after the error
    if not await streamed(request, resp, job, produce, _error_event):
        return resp
    stop_reason, matched = ms.stop_of(job, finish, stop_sequence)
    delta = {"stop_reason": stop_reason, "stop_sequence": matched}
    done = {"type": "message_delta", "delta": delta, "usage": ms.usage(job)}
    await resp.write(ms.event("message_delta", done) + _events([("message_stop", _STOP)]))
    await resp.write_eof()
    return resp


_STOP = {"type": "message_stop"}


def _events(events: list[ms.Event]) -> bytes:
    return b"".join(ms.event(name, data) for name, data in events)


def _error_event(error: ApiError, usage_lost: bool) -> bytes:
    return ms.event("error", anthropic_error(error.status, error.message)[1])


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
