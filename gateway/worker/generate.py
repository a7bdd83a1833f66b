"""POST /kvgate/v1/generate: the native path a gateway's `remote` adapter uses.

The body is a GenRequest record as `to_dict` writes it (its cache salt and published
prefix length included: a worker never derives salts). The reply streams the engine's
GenChunks as they come, one JSON object per line. An error before the first line is an
HTTP error; after it, one last `{"error": ...}` line (also when the drain's deadline
cuts the stream: gateway/http/drain.py). A client that hangs up cancels
this handler (handler_cancellation), which closes the engine's stream: the request is
aborted and its KV blocks freed. A request with `kv_source` first pulls its prompt's
blocks from that prefill worker (kv_pull.py), or computes them here if it cannot.

A gateway whose client left first calls POST /kvgate/v1/abort with the request's id: the
same abort, answered with what the engine computed of the prompt by then (running.py),
which the gateway bills; then it closes the stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from engine_api.errors import BackendError, BadRequestError
from engine_api.images import ImageInput
from engine_api.records import GenChunk, GenRequest, Progress
from gateway.http.drain import SHUTTING_DOWN
from gateway.http.errors import ApiError
from gateway.http.util import json_bytes, json_response, parse_body
from gateway.observe.tracing import current_span, step
from gateway.serving.images import ImageLimits, received
from gateway.serving.traces import recorded
from gateway.worker.errors import api_error
from gateway.worker.schemas import AbortRequest, JsonObject
from gateway.worker.state import WORKER, WorkerState

NDJSON = "application/x-ndjson"


async def read_request(request: web.Request) -> GenRequest:
    """The body's GenRequest, checked against this worker's model (else a 400), its
    images' files decoded and checked against the digests sent."""
    body = await parse_body(request, JsonObject)
    state = request.app[WORKER]
    try:
        if not body.root.get("images"):
            req = GenRequest.from_dict(body.root)
            state.check_request(req)
            return req
        req = await asyncio.to_thread(GenRequest.from_dict, body.root)  # files' base64
        state.check_request(req)
    except BadRequestError as e:
        raise api_error(e) from None
    images = await received(ImageLimits.of(state.settings), req.images)
    return dataclasses.replace(req, images=images)


async def wire_images(state: WorkerState, sent: list[Any]) -> list[ImageInput]:
    """/tokenize's `images` (ImageInput records as the gateway wrote them), decoded and
    checked as a /generate request's are; a 400 for any that is malformed."""
    try:
        images = await asyncio.to_thread(lambda: [ImageInput.from_dict(d) for d in sent])
    except BadRequestError as e:
        raise api_error(e) from None
    return await received(ImageLimits.of(state.settings), images)


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[WORKER]
    req = await read_request(request)
    with state.running.track(req.request_id) as progress:
        return await _generate(request, state, req, progress)


async def abort(request: web.Request) -> web.Response:
    """POST /kvgate/v1/abort: stop a request running here (running.py) and answer what
    its engine computed of it, its step in flight included; 404 if none runs."""
    body = await parse_body(request, AbortRequest)
    progress = await request.app[WORKER].running.stop(body.request_id)
    if progress is None:
        raise ApiError(404, "no such request runs here", code="not_found", param="request_id")
    return json_response({"prompt_tokens": progress.tokens, "cached_tokens": progress.cached})


async def _generate(
    request: web.Request, state: WorkerState, req: GenRequest, progress: Progress
) -> web.StreamResponse:
    if req.kv_source is not None:
        with step(state.tracing, "kvgate.kv_pull"):
            await state.puller.pull(state.backend, req)
        req = dataclasses.replace(req, kv_source=None)
    stream = state.backend.generate(req, progress)
    span = current_span(state.tracing)  # the request's server span, if it is traced
    if span is not None and span.is_recording():
        stream = recorded(span, req, stream)
    try:
        try:
            with state.drain.cuttable():
                first = await first_chunk(stream)
        except asyncio.CancelledError:
            if not state.drain.was_cut():
                raise
            raise SHUTTING_DOWN from None  # nothing went out: the gateway tries elsewhere
        resp = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            with state.drain.cuttable():
                async for chunk in chunks_from(first, stream):
                    await resp.write(_line(chunk.to_dict()))
        except (BadRequestError, BackendError) as e:
            await resp.write(_line(api_error(e).body()))
        except asyncio.CancelledError:
            if not state.drain.was_cut():
                raise
            await resp.write(_line(SHUTTING_DOWN.body()))  # the drain's deadline
    finally:
        await stream.aclose()
    await resp.write_eof()
    return resp


async def first_chunk(stream: AsyncIterator[GenChunk]) -> GenChunk | None:
    """The stream's first chunk; the engine's errors before it as HTTP errors."""
    try:
        return await anext(stream, None)
    except (BadRequestError, BackendError) as e:
        raise api_error(e) from None


async def chunks_from(
    first: GenChunk | None, rest: AsyncIterator[GenChunk]
) -> AsyncIterator[GenChunk]:
    """`first` (the chunk `first_chunk` took), then the rest of the stream."""
    if first is None:
        return
    yield first
    async for chunk in rest:
        yield chunk


def _line(obj: dict[str, Any]) -> bytes:
    return json_bytes(obj) + b"\n"
