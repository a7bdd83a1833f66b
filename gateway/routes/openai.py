"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models, and
vLLM's /tokenize and /detokenize.

/tokenize and /detokenize take a tenant's key and its allowed models. Neither is billed
(vLLM bills them nowhere either): they run no model. Each still counts as a request of the
tenant's and its key's rpm and concurrency (gateway.serving.counted), admitted before its
body is read, as rendering a large prompt costs seconds of CPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web

from gateway.backends import (
    Backend,
    BackendError,
    BadRequestError,
    GenChunk,
    TokenLogprob,
    Usage,
)
from gateway.http.errors import ApiError
from gateway.http.util import json_response, off_loop_if, parse_body, sse
from gateway.ondemand import held
from gateway.schemas.inference import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from gateway.schemas.openai_format import (
    adapter_entry,
    chat_choice,
    chunk_body,
    completion_choice,
    model_entry,
    response_body,
    usage_chunk,
)
from gateway.serving.admission import prepare
from gateway.serving.counted import counted
from gateway.serving.echo import Echo
from gateway.serving.job import Job
from gateway.serving.model_access import model_card, served_model
from gateway.serving.outcome import (
    LARGE_CALL_CHARS,
    SSE_HEADERS,
    finish_or_503,
    streamed,
    whole_answer,
)
from gateway.serving.parsed_output import Whole, choice_outputs, reasoning_tokens
from gateway.serving.parser_choice import parsers_of_card
from gateway.serving.rendering import rendered_tokens
from gateway.state import GW, GatewayState

log = logging.getLogger("kvgate")
T = TypeVar("T")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def list_models(request: web.Request) -> web.Response:
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    created = int(gw.traffic.started_at)
    # kvgate's own object: the output parsers that read the model's replies
    data = [
        model_entry(card, created) | {"kvgate": parsers_of_card(gw, card).describe()}
        for card in gw.router.cards.values()
        if principal.may_use(card.id)
    ]
    for adapter in gw.adapters.usable(principal.tenant_id):  # a tenant's own and the public
        base = gw.router.cards.get(adapter.base_model)
        if base is not None and principal.may_use(adapter.name):
            entry = adapter_entry(adapter.name, base, created)
            data.append(entry | {"kvgate": parsers_of_card(gw, base).describe()})
    return json_response({"object": "list", "data": data})


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's shape: the token ids a completion of this prompt or chat would be given."""
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    async with counted(gw, principal) as headers:
        body = await parse_body(request, TokenizeRequest)
        card = model_card(gw, principal, body.model)
        rendered, tools = body.rendered(), body.tool_dicts()
        kwargs = body.chat_template_kwargs
        tokens = await rendered_tokens(gw, principal, body.model, rendered, tools, kwargs)
    answer = {"tokens": tokens, "count": len(tokens), "max_model_len": card.context_length}
    return json_response(answer, headers=headers)


async def detokenize(request: web.Request) -> web.Response:
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    async with counted(gw, principal) as headers:
        body = await parse_body(request, DetokenizeRequest)
        model_card(gw, principal, body.model)
        served = served_model(gw, principal, body.model)  # an adapter's: its base model's
        skip = body.skip_special_tokens
        text = await on_a_replica(gw, served, lambda b: b.detokenize(served, body.tokens, skip))
    return json_response({"prompt": text}, headers=headers)


async def on_a_replica(gw: GatewayState, model: str, call: Callable[[Backend], Awaitable[T]]) -> T:
    """`call` on the first healthy replica of `model` that answers (a remote one may have
    just died); the last one's error is the client's."""
    try:
        async with held(gw, model):  # loaded, if it is a models directory's
            candidates = gw.router.candidates(model)
            for candidate in candidates[:-1]:
                with contextlib.suppress(BackendError):
                    return await call(candidate.backend)
            return await call(candidates[-1].backend)
    except BadRequestError as e:
        raise ApiError(400, str(e)) from None
    except BackendError as e:
        raise ApiError(503, str(e), code="backend_unavailable") from None


async def _complete(request: web.Request, chat: bool) -> web.StreamResponse:
    gw = request.app[GW]
    principal = await gw.authenticate(request)
    body = await parse_body(request, ChatCompletionRequest if chat else CompletionRequest)
    job = await prepare(gw, principal, body, chat)
    if body.stream:
        return await _stream(request, job, body.include_usage)
    return await _whole(job)


async def _whole(job: Job) -> web.Response:
    k = job.num_choices
    texts: list[list[str]] = [[] for _ in range(k)]
    finish: list[str | None] = [None] * k
    logprobs: list[list[TokenLogprob | str]] | None = None
    if job.requests[0].sampling.logprobs is not None:
        logprobs = [[] for _ in range(k)]
    echoes = job.echoes is not None
    outputs = choice_outputs(job, whole=True) if job.chat else []
    wholes = [Whole() for _ in outputs]
    async with whole_answer(job):
        async for i, chunk in job.events():
            if echoes and not texts[i] and (echo := job.echo_of(i)) is not None:
                texts[i].append(echo.text)
                if logprobs is not None:
                    logprobs[i].extend(echo.logprobs(chunk.prompt_logprobs))
            if outputs:
                outputs[i].take(chunk)
            else:
                texts[i].append(chunk.text)
            if chunk.finish_reason:
                finish[i] = chunk.finish_reason
            if logprobs is not None and chunk.logprobs:
                logprobs[i].extend(chunk.logprobs)
    for i, out in enumerate(outputs):
        large = out.chars > LARGE_CALL_CHARS
        rest, finish[i] = await off_loop_if(large, out.finish, finish[i])
        wholes[i].add(rest)
    choices = [
        _choice(job, i, texts, wholes[i] if wholes else None, finish[i], logprobs) for i in range(k)
    ]
    await finish_or_503(job, 200, choices[0]["finish_reason"])
    thought = reasoning_tokens(outputs, job.completion_tokens) if job.chat else None
    body = response_body(
        job.chat, job.request_id, job.created, job.model, choices, _usage(job), thought
    )
    return json_response(body, headers=job.headers())


async def _stream(request: web.Request, job: Job, include_usage: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS | job.headers())
    first = [True] * job.num_choices
    outputs = choice_outputs(job) if job.chat else []

    async def produce() -> str | None:
        last_finish = None
        async for i, chunk in job.events():
            if first[i] and (echo := job.echo_of(i)) is not None:
                await resp.write(sse(_echo_chunk(job, i, echo, chunk)))
            finish, piece, large = chunk.finish_reason, None, False
            if outputs:
                out = outputs[i]
                piece = out.feed(chunk)
                large = out.chars > LARGE_CALL_CHARS
                if finish:
                    rest, finish = await off_loop_if(large, out.finish, finish)
                    piece.extend(rest)
                elif not (
                    piece.content or piece.reasoning or piece.calls or first[i] or chunk.logprobs
                ):
                    # text the parser holds (a marker's start, a call's closing brace):
                    # nothing to say yet, and vLLM sends nothing (its logprobs would go)
                    continue
            last_finish = finish or last_finish
            body = chunk_body(
                job.chat,
                job.request_id,
                job.created,
                job.model,
                i,
                chunk.text if piece is None else piece.content,
                finish,
                chunk.logprobs,
                first[i],
                None if piece is None else piece.calls,
                "" if piece is None else piece.reasoning,
            )
            large = large and piece is not None and piece.chars() > LARGE_CALL_CHARS
            # the common chunk is encoded inline: no coroutine a chunk to decide that
            await resp.write(await off_loop_if(large, sse, body) if large else sse(body))
            first[i] = False
        return last_finish

    if await streamed(request, resp, job, produce, _error_event):
        if include_usage:
            thought = reasoning_tokens(outputs, job.completion_tokens) if job.chat else None
            chunk = usage_chunk(
                job.chat, job.request_id, job.created, job.model, _usage(job), thought
            )
            await resp.write(sse(chunk))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    return resp


def _error_event(error: ApiError, usage_lost: bool) -> bytes:
    """A stream's error: after a backend's failure it still ends with [DONE]; without
    its usage row the response is not complete, so no [DONE]."""
    return sse(error.body()) + (b"" if usage_lost else b"data: [DONE]\n\n")


def _echo_chunk(job: Job, i: int, echo: Echo, chunk: GenChunk) -> dict:
    """The stream's first chunk of a choice with echo: the prompt, and its logprobs."""
    lps = None
    if job.requests[i].sampling.logprobs is not None:
        lps = echo.logprobs(chunk.prompt_logprobs)
    return chunk_body(False, job.request_id, job.created, job.model, i, echo.text, None, lps)


def _choice(
    job: Job,
    i: int,
    texts: list[list[str]],
    whole: Whole | None,
    finish: str | None,
    logprobs: list[list[TokenLogprob | str]] | None,
) -> dict:
    lps = None if logprobs is None else logprobs[i]
    if whole is None:
        return completion_choice(i, "".join(texts[i]), finish, lps)
    calls = whole.tool_calls()
    content: str | None = whole.text()
    if calls:  # the space around a call is not an answer
        content = content.strip() or None  # type: ignore[union-attr]
    return chat_choice(i, content, finish, lps, calls, whole.thought())  # type: ignore[arg-type]


def _usage(job: Job) -> Usage:
    return Usage(
        job.prompt_tokens, job.completion_tokens, job.cached_tokens, image_tokens=job.image_tokens
    )
