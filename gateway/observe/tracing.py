"""OpenTelemetry traces: whether they are sent and where, a process's own tracer, and
spans that cost nothing when tracing is off.

Tracing is on when an OTLP endpoint is configured: `--otlp-traces-endpoint` (vLLM's
flag; `otlp_traces_endpoint` in the config file, KVGATE_OTLP_TRACES_ENDPOINT), or the
standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT. The protocol
is OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL (http/protobuf, the
standard's default, or grpc), the service OTEL_SERVICE_NAME; OTEL_SDK_DISABLED=true or
OTEL_TRACES_EXPORTER=none turn it off. The exporters read the other OTEL_EXPORTER_OTLP_*
variables (headers, timeout, certificates, compression) themselves, the SDK's sampler
OTEL_TRACES_SAMPLER(_ARG), the batch processor OTEL_BSP_*.

Each gateway and each worker owns a Tracing, held in its state, instead of setting
OpenTelemetry's process-global provider: two gateways in one process (as in tests)
export apart, and a library that sets the global provider cannot take kvgate's spans.
Its spans are cheap records of kvgate's own (gateway/observe/span_record.py), exported
by the SDK from a child process (gateway/observe/span_export.py): the SDK's spans and
its OTLP encoding cost the gateway's one Python process ~0.6 ms a request.
What is shared is OpenTelemetry's context, a contextvar per task: the current span, which
is how a step finds its parent and how the remote adapter finds the traceparent it
sends upstream.

Off, there is no Tracing (None): `step` hands out one shared null context, the request
middleware is not installed, and no span object is made. A span never holds a key, a
prompt or a completion: an exception is recorded by its type or HTTP status only, since
its message may quote what the client sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.observe.span_export import SpanExport
from gateway.observe.span_record import SpanRecord

HTTP_PROTOBUF, GRPC = "http/protobuf", "grpc"
PROTOCOLS = (HTTP_PROTOBUF, GRPC)

# OpenTelemetry's GenAI semantic conventions, where they name what kvgate knows
GEN_AI_OPERATION = "gen_ai.operation.name"  # chat | text_completion | embeddings
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_CHOICES = "gen_ai.request.choice.count"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_CACHED_TOKENS = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_TTFT = "gen_ai.latency.time_to_first_token"  # seconds; vLLM's name (none standard)
# kvgate's own
TENANT = "kvgate.tenant.id"
REPLICA = "kvgate.replica"

_W3C = TraceContextTextMapPropagator()  # stateless: reads and writes traceparent/tracestate
_OFF: AbstractContextManager[None] = contextlib.nullcontext()  # reusable, holds nothing
UNSAMPLED = TraceFlags(TraceFlags.DEFAULT)


@dataclass(frozen=True)
class TraceExport:
    """Where spans go. endpoint None: the exporter reads OTEL_EXPORTER_OTLP_*ENDPOINT."""

    endpoint: str | None
    protocol: str
    service_name: str


def trace_export(
    endpoint: str | None, service: str, environ: Mapping[str, str] | None = None
) -> TraceExport | None:
    """The export `endpoint` (the flag's, or None) and the OTEL_* variables ask for, or
    None when tracing is off; ValueError for a protocol kvgate cannot send."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    configured = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not (endpoint or configured):
        return None
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or HTTP_PROTOBUF
    ).strip()
    if protocol not in PROTOCOLS:
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be one of {', '.join(PROTOCOLS)}, "
            f"got {protocol!r}"
        )
    return TraceExport(endpoint or None, protocol, env.get("OTEL_SERVICE_NAME") or service)


class Tracing:
    """One process's tracer: its own sampler, and its spans exported from a child
    process (gateway/observe/span_export.py)."""

    def __init__(self, export: TraceExport) -> None:
        # the SDK is imported only when tracing is on: off, no start-up cost either
        from opentelemetry.sdk.trace import TracerProvider

        # the SDK's sampler as OTEL_TRACES_SAMPLER(_ARG) name it, asked at each trace's
        # root (a request's span); a step follows its parent, as the parent-based do
        self.sampler = TracerProvider(shutdown_on_exit=False).sampler
        self.export = SpanExport(export.endpoint, export.protocol == GRPC, export.service_name)

    def server_span(
        self, name: str, headers: Mapping[str, str], attributes: dict[str, Any]
    ) -> AbstractContextManager[Span]:
        """A request's span, made current while the handler runs (its steps, and the
        calls it makes upstream, find it there): a child of the caller's span when its
        W3C traceparent says so, else a new trace."""
        span = self._root(name, _W3C.extract(headers), SpanKind.SERVER, attributes, None)
        return _Scope(span, current=True)

    def step(self, name: str) -> AbstractContextManager[Span]:
        """A child of the current span for the block: a leaf (it is not made current)."""
        return _Scope(self.start(name, None), current=False)

    def start(
        self,
        name: str,
        parent: Span | None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: dict[str, Any] | None = None,
        start_time: int | None = None,
    ) -> Span:
        """A span the caller ends, under `parent` (else the current span). Not made
        current: one that lives across a stream's yields would leak into its reader."""
        if parent is None:
            parent = trace.get_current_span()
        if isinstance(parent, SpanRecord):
            return parent.child(name, _span_id(), kind, attributes, start_time)
        if parent.get_span_context().is_valid:  # a trace that is not sampled
            return parent
        return self._root(name, None, kind, attributes, start_time)

    def _root(
        self,
        name: str,
        context: otel_context.Context | None,
        kind: SpanKind,
        attributes: dict[str, Any] | None,
        start_time: int | None,
    ) -> Span:
        """A span with no parent in this process: sampled as the sampler says."""
        parent = trace.get_current_span(context).get_span_context()
        trace_id = parent.trace_id if parent.is_valid else random.getrandbits(128)
        decision = self.sampler.should_sample(context, trace_id, name, kind, attributes)
        state = decision.trace_state
        if not decision.decision.is_sampled():  # its context still goes upstream: "not sampled"
            return trace.NonRecordingSpan(
                SpanContext(trace_id, _span_id(), False, UNSAMPLED, state)
            )
        if decision.attributes:
            attributes = {**(attributes or {}), **decision.attributes}
        parent_id = parent.span_id if parent.is_valid else None
        return SpanRecord(
            *(name, trace_id, _span_id(), parent_id, parent.is_remote, kind, attributes),
            *(start_time, state, self.export.add),
        )

    async def close(self) -> None:
        """Export what is still buffered, then stop (off the loop: it blocks on the send)."""
        await asyncio.to_thread(self.export.close)


def step(tracing: Tracing | None, name: str) -> AbstractContextManager[Span | None]:
    """`tracing.step(name)`, or, with tracing off, a shared null context (no span)."""
    return _OFF if tracing is None else tracing.step(name)


def current_span(tracing: Tracing | None) -> Span | None:
    """The task's current span while tracing is on (a request's server span in its
    handler), else None."""
    return None if tracing is None else trace.get_current_span()


class AsCurrent:
    """`span` current for the block only: around the read of a stream that sends its
    request upstream, so the request carries the span's traceparent."""

    __slots__ = ("span", "_token")

    def __init__(self, span: Span) -> None:
        self.span = span

    def __enter__(self) -> None:
        self._token = otel_context.attach(trace.set_span_in_context(self.span))

    def __exit__(self, *exc: object) -> None:
        otel_context.detach(self._token)


def failed(span: Span, e: BaseException) -> None:
    """The span's error by the exception's HTTP status or type, never its message."""
    status = getattr(e, "status", None)
    span.set_attribute("error.type", str(status) if isinstance(status, int) else type(e).__name__)
    span.set_status(Status(StatusCode.ERROR))


class _Scope:
    """A span ended when the block leaves, failed by what it raised; current while the
    block runs when `current`. A class, not a generator: it runs for every step of
    every request."""

    __slots__ = ("span", "_current")

    def __init__(self, span: Span, current: bool) -> None:
        self.span = span
        self._current = AsCurrent(span) if current else None

    def __enter__(self) -> Span:
        if self._current is not None:
            self._current.__enter__()
        return self.span

    def __exit__(self, kind: object, e: BaseException | None, tb: object) -> None:
        if e is not None:
            failed(self.span, e)
        if self._current is not None:
            self._current.__exit__()
        self.span.end()


def _span_id() -> int:
    return random.getrandbits(64) or 1  # 0 is the invalid span id
