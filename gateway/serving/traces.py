"""A traced request's spans that know the gateway's records: the engine (or upstream)
call of each choice with its wait in the fair queue, and the request's usage on its
server span, named as OpenTelemetry's GenAI semantic conventions name them.

Only counts, ids, names and times go in: never a prompt, a completion or a key. Only
called while tracing is on (GatewayState.tracing); off, a Job streams without them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from opentelemetry.trace import Span, SpanKind

from gateway.backends import EmbedRequest, GenChunk, GenRequest
from gateway.observe.tracing import (
    GEN_AI_CACHED_TOKENS,
    GEN_AI_CHOICES,
    GEN_AI_FINISH_REASONS,
    GEN_AI_INPUT_TOKENS,
    GEN_AI_MAX_TOKENS,
    GEN_AI_OPERATION,
    GEN_AI_OUTPUT_TOKENS,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_RESPONSE_ID,
    GEN_AI_TTFT,
    REPLICA,
    TENANT,
    AsCurrent,
    Tracing,
    failed,
)
from gateway.serving.metering import ChoiceMeter

QUEUE_WAIT = "kvgate.queue"
# opens a choice's stream: (its request, a callback for when the fair queue gave it a slot)
OpenStream = Callable[[GenRequest, Callable[[int], None]], AsyncIterator[GenChunk]]


def operation(chat: bool) -> str:
    return "chat" if chat else "text_completion"


def request_attributes(chat: bool, model: str, tenant_id: str, choices: int) -> dict[str, Any]:
    """What the server span of an admitted request says about it (the choice count only
    when not 1, as the conventions ask: every attribute is paid for per request)."""
    attributes: dict[str, Any] = {
        GEN_AI_OPERATION: operation(chat),
        GEN_AI_REQUEST_MODEL: model,
        TENANT: tenant_id,
    }
    if choices != 1:
        attributes[GEN_AI_CHOICES] = choices
    return attributes


def embedding_attributes(req: EmbedRequest, input_tokens: int) -> dict[str, Any]:
    """An embedding request's call span: which model, for whom, and its tokens."""
    return {
        GEN_AI_OPERATION: "embeddings",
        GEN_AI_REQUEST_MODEL: req.model,
        GEN_AI_RESPONSE_ID: req.request_id,
        GEN_AI_INPUT_TOKENS: input_tokens,
        TENANT: req.tenant_id,
    }


def usage_attributes(
    request_id: str,
    input_tokens: int,
    output_tokens: int,
    cached_tokens: int,
    ttft: float | None,
    finish_reason: str | None,
) -> dict[str, Any]:
    """A finished request's usage as billed, for its server span."""
    attributes: dict[str, Any] = {
        GEN_AI_RESPONSE_ID: request_id,
        GEN_AI_INPUT_TOKENS: input_tokens,
        GEN_AI_OUTPUT_TOKENS: output_tokens,
        GEN_AI_CACHED_TOKENS: cached_tokens,
    }
    if ttft is not None:
        attributes[GEN_AI_TTFT] = ttft
    if finish_reason is not None:
        attributes[GEN_AI_FINISH_REASONS] = (finish_reason,)
    return attributes


async def traced_call(
    tracing: Tracing,
    parent: Span | None,
    chat: bool,
    model: str,
    replica: str,
    req: GenRequest,
    meter: ChoiceMeter,
    open_stream: OpenStream,
) -> AsyncIterator[GenChunk]:
    """One choice's call of its replica in a client span (`chat <model>`), with a child
    for its wait in the fair queue. The span is current around each read of the stream
    only, so the remote adapter's request upstream carries its traceparent and the
    upstream's spans join the trace."""
    attributes = {
        GEN_AI_OPERATION: operation(chat),
        GEN_AI_REQUEST_MODEL: model,
        GEN_AI_RESPONSE_ID: req.request_id,
        GEN_AI_MAX_TOKENS: req.sampling.max_tokens,
        REPLICA: replica,
    }
    span = tracing.start(f"{operation(chat)} {model}", parent, SpanKind.CLIENT, attributes)
    started = time.perf_counter()

    def slot_given(asked_ns: int) -> None:
        tracing.start(QUEUE_WAIT, span, start_time=asked_ns).end()

    stream = open_stream(req, slot_given)
    finish = None
    try:
        with AsCurrent(span):  # the first read sends the request upstream
            chunk = await anext(stream, None)
        ttft = None
        while chunk is not None:
            if ttft is None and (chunk.token_ids or chunk.text):
                ttft = time.perf_counter() - started
                span.set_attribute(GEN_AI_TTFT, ttft)
            finish = chunk.finish_reason or finish
            yield chunk
            chunk = await anext(stream, None)
    except BaseException as e:  # a failure, or the reader closed it (the client left)
        failed(span, e)
        raise
    finally:
        await stream.aclose()
        span.set_attributes(
            {
                GEN_AI_INPUT_TOKENS: meter.prompt,
                GEN_AI_OUTPUT_TOKENS: meter.count,
                GEN_AI_CACHED_TOKENS: meter.cached,
            }
        )
        if finish is not None:
            span.set_attribute(GEN_AI_FINISH_REASONS, (finish,))
        span.end()


async def recorded(
    span: Span, req: GenRequest, stream: AsyncIterator[GenChunk]
) -> AsyncIterator[GenChunk]:
    """An engine's stream for `req`, its time to first token and usage (the last
    chunk's) set on `span`: a worker's server span for the gateway's call."""
    span.set_attributes(
        {
            GEN_AI_OPERATION: operation(False),
            GEN_AI_REQUEST_MODEL: req.model,
            GEN_AI_RESPONSE_ID: req.request_id,
            GEN_AI_MAX_TOKENS: req.sampling.max_tokens,
            GEN_AI_INPUT_TOKENS: len(req.prompt_token_ids),
            TENANT: req.tenant_id,
        }
    )
    started, first = time.perf_counter(), True
    async with contextlib.aclosing(stream):
        async for chunk in stream:
            if first and (chunk.token_ids or chunk.text):
                first = False
                span.set_attribute(GEN_AI_TTFT, time.perf_counter() - started)
            if chunk.finish_reason is not None:
                span.set_attribute(GEN_AI_FINISH_REASONS, (chunk.finish_reason,))
                if chunk.usage is not None:
                    span.set_attributes(
                        {
                            GEN_AI_OUTPUT_TOKENS: chunk.usage.completion_tokens,
                            GEN_AI_CACHED_TOKENS: chunk.usage.cached_tokens,
                        }
                    )
            yield chunk
