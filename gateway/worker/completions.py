"""POST /v1/completions on a worker: OpenAI's (and vLLM's) completions for callers that
reach the engine directly, one prompt and one choice per request.

Bodies and chunks are the gateway's own (gateway/schemas/openai_format.py), the sampling
options are built as the gateway builds them, and `max_tokens` defaults to what the
context leaves, as the gateway plans it for a tenant without limits.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator

from aiohttp import web

from engine_api.errors import BackendError, BadRequestError
from engine_api.records import GenChunk, GenRequest, TokenLogprob, Usage
from gateway.http.util import json_response, parse_body, sse
from gateway.schemas.openai_format import chunk_body, completion_choice, response_body, usage_chunk
from gateway.serving.sampling import sampling, structured_output
from gateway.serving.token_plan import plan_tokens
from gateway.tenancy.quota import QuotaLimits
from gateway.worker.errors import api_error
from gateway.worker.generate import chunks_from, first_chunk
from gateway.worker.schemas import WorkerCompletionRequest
from gateway.worker.state import WORKER


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[WORKER]
    body = await parse_body(request, WorkerCompletionRequest)
    card = state.card(body.model)
    try:
        prompt = await state.backend.render(body.model, body.prompts()[0])
    except (BadRequestError, BackendError) as e:
        raise api_error(e) from None
    plan = plan_tokens(
        [prompt], 1, body.max_tokens, card.context_length, QuotaLimits(), "prompt", body.min_tokens
    )
    req = GenRequest(
        "cmpl-" + os.urandom(12).hex(),
        body.model,
        prompt,
        sampling(body, plan.max_tokens[0], 0, structured_output(body)),
        cache_salt=body.cache_salt,
        priority=body.priority,
    )
    stream = state.backend.generate(req)
    try:
        first = await first_chunk(stream)
        chunks = chunks_from(first, stream)
        if body.stream:
            return await _stream(request, req, chunks, body.include_usage)
        return await _whole(req, chunks)
    finally:
        await stream.aclose()


async def _whole(req: GenRequest, chunks: AsyncIterator[GenChunk]) -> web.Response:
    texts: list[str] = []
    finish: str | None = None
    usage = Usage(len(req.prompt_token_ids))
    logprobs: list[TokenLogprob] | None = [] if req.sampling.logprobs is not None else None
    try:
        async for chunk in chunks:
            texts.append(chunk.text)
            finish = chunk.finish_reason or finish
            usage = _count(usage, chunk)
            if logprobs is not None and chunk.logprobs:
                logprobs.extend(chunk.logprobs)
    except (BadRequestError, BackendError) as e:
        raise api_error(e) from None
    choice = completion_choice(0, "".join(texts), finish, logprobs)
    created = int(time.time())
    return json_response(response_body(False, req.request_id, created, req.model, [choice], usage))


async def _stream(
    request: web.Request, req: GenRequest, chunks: AsyncIterator[GenChunk], include_usage: bool
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    rid, created, model = req.request_id, int(time.time()), req.model
    usage = Usage(len(req.prompt_token_ids))
    try:
        async for chunk in chunks:
            usage = _count(usage, chunk)
            text, finish, lps = chunk.text, chunk.finish_reason, chunk.logprobs
            await resp.write(sse(chunk_body(False, rid, created, model, 0, text, finish, lps)))
    except (BadRequestError, BackendError) as e:
        await resp.write(sse(api_error(e).body()))
        await resp.write(b"data: [DONE]\n\n")
        return resp
    if include_usage:
        await resp.write(sse(usage_chunk(False, rid, created, model, usage)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _count(usage: Usage, chunk: GenChunk) -> Usage:
    """The engine's usage on the last chunk is the record; until then, count ids."""
    if chunk.usage is not None:
        return chunk.usage
    usage.completion_tokens += len(chunk.token_ids)
    return usage
