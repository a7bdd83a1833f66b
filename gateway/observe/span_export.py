"""Exporting a process's spans from a child process of its own.

What costs most in tracing is not recording a span but exporting it: the SDK's span
objects, its batch processor, and above all encoding the OTLP protobuf, all holding the
GIL of the gateway's one Python process. So the process that records spans
(SpanRecords, gateway/observe/span_record.py) ships them in batches, plain tuples, one
queue put every FLUSH_S, to a spawned child; the child turns each into an SDK
ReadableSpan and exports it with the SDK's own BatchSpanProcessor and OTLP exporter, so
every OTEL_EXPORTER_OTLP_*, OTEL_BSP_*, OTEL_RESOURCE_ATTRIBUTES and attribute-limit
variable works as the SDK defines it (the child inherits the environment).

Closing flushes what is buffered, tells the child to stop, and waits for it to export
what it holds. The child leaves on its own when its parent is gone.

An endpoint that is down is said once, and once again when it answers (ReportedExporter):
the SDK's exporters log a line on every retry of every batch, which on a gateway whose
collector is down buried everything else in its log.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import signal

from gateway.observe.span_record import SAMPLED, Shipped, SpanRecord

FLUSH_S = 0.1  # how long an ended span waits in this process: a put per batch, not per span
CLOSE_S = 30.0  # how long closing waits for the child's last export
log = logging.getLogger("kvgate.tracing")


class SpanExport:
    """The exporting child of one process's tracing, and the batch it is filling."""

    def __init__(self, endpoint: str | None, grpc: bool, service_name: str) -> None:
        context = multiprocessing.get_context("spawn")  # never fork a process with threads
        self._queue = context.Queue()
        self._child = context.Process(
            target=serve,
            args=(self._queue, endpoint, grpc, service_name, os.getpid()),
            name="kvgate-traces",
            daemon=True,
        )
        self._child.start()
        self._pending: list[SpanRecord] = []
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    def add(self, span: SpanRecord) -> None:
        """An ended span: shipped with the others within FLUSH_S."""
        if self._closed:
            return
        self._pending.append(span)
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # ended outside an event loop: nothing to wait with
                self.flush()
                return
            self._timer = loop.call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        """Ship the ended spans to the child now (a put: the queue's thread sends it)."""
        self._timer = None
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        if not self._child.is_alive():
            log.warning("the trace exporting process is gone: %d spans dropped", len(batch))
            return
        self._queue.put([span.shipped() for span in batch])

    def close(self) -> None:
        """Flush, then wait for the child to export everything and exit (blocking)."""
        if self._timer is not None:
            self._timer.cancel()
        self.flush()
        self._closed = True
        if self._child.is_alive():
            self._queue.put(None)
        self._child.join(CLOSE_S)
        if self._child.is_alive():
            log.warning("the trace exporting process did not stop: terminated")
            self._child.terminate()
            self._child.join()
        self._queue.close()
        self._queue.join_thread()


def serve(
    batches: multiprocessing.Queue,
    endpoint: str | None,
    grpc: bool,
    service_name: str,
    parent_pid: int,
) -> None:
    """The child: export every shipped span until told to stop or its parent is gone."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import SpanLimits
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C stops the parent, which stops it
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")  # as serve's
    log.setLevel(logging.INFO)
    resource = Resource.create({SERVICE_NAME: service_name})
    processor = BatchSpanProcessor(ReportedExporter(exporter(endpoint, grpc), endpoint))
    scope = InstrumentationScope("kvgate")
    limits = SpanLimits()
    try:
        while True:
            try:
                batch = batches.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent_pid:
                    break
                continue
            if batch is None:
                break
            for fields in batch:
                processor.on_end(readable(fields, resource, scope, limits))
    finally:
        processor.shutdown()  # exports what is still buffered


def readable(fields: Shipped, resource, scope, limits):
    """A shipped span as the SDK's ReadableSpan, its attributes bound by the SDK's limits."""
    from opentelemetry.attributes import BoundedAttributes
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceState

    name, trace_id, span_id, parent_id, remote, kind, start, end = fields[:8]
    attributes, status, description, events, state = fields[8:]
    trace_state = TraceState.from_header([state]) if state else None
    parent = None
    if parent_id is not None:
        parent = SpanContext(trace_id, parent_id, remote, SAMPLED, trace_state)
    bounded = BoundedAttributes(
        limits.max_span_attributes,
        attributes,
        immutable=True,
        max_value_len=limits.max_span_attribute_length,
    )
    return ReadableSpan(
        name=name,
        context=SpanContext(trace_id, span_id, False, SAMPLED, trace_state),
        parent=parent,
        resource=resource,
        attributes=bounded,
        events=[Event(n, a, t) for n, a, t in events or ()],
        kind=SpanKind(kind),
        status=Status(StatusCode(status), description),
        start_time=start,
        end_time=end,
        instrumentation_scope=scope,
    )


def exporter(endpoint: str | None, grpc: bool):
    """The SDK's OTLP span exporter, gRPC's or HTTP/protobuf's (it reads
    OTEL_EXPORTER_OTLP_*; endpoint None: from there)."""
    if grpc:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=endpoint)


class ReportedExporter:
    """An OTLP exporter whose failures are logged once, and its recovery once.

    The SDK exporters' own lines (a warning per retry, an error per batch dropped) are
    kept from the log: the first of a failing run is quoted as the reason."""

    def __init__(self, inner, endpoint: str | None) -> None:
        self._inner = inner
        # both OTLP exporters keep the URL they send to (endpoint None: from OTEL_*)
        self._where = getattr(inner, "_endpoint", endpoint) or "the OTLP endpoint"
        self._said = _SdkLines()
        sdk = logging.getLogger("opentelemetry.exporter.otlp")
        sdk.addHandler(self._said)
        sdk.propagate = False
        self._failing = False
        self._dropped = 0  # spans of the batches that failed since the last success
        # the inner's own: the processor reads shutdown's arguments to pass it a timeout
        self.shutdown = inner.shutdown
        self.force_flush = inner.force_flush

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        self._said.lines.clear()
        result = self._inner.export(spans)
        if result is SpanExportResult.SUCCESS:
            if self._failing:
                log.info(
                    "traces reach %s again (%d spans were dropped while it did not answer)",
                    self._where,
                    self._dropped,
                )
            self._failing, self._dropped = False, 0
        else:
            if not self._failing:
                reason = self._said.lines[0] if self._said.lines else "the export failed"
                log.warning(
                    "traces cannot be sent to %s: spans are dropped until it answers (said "
                    "once, and again when it does): %s",
                    self._where,
                    reason,
                )
            self._failing = True
            self._dropped += len(spans)
        return result


class _SdkLines(logging.Handler):
    """What the SDK's OTLP exporters logged during one export, not printed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if str(record.msg).startswith("Transient error") and args:
            # a retry's line: the error is its first argument (gRPC's details its fifth),
            # the rest says it will retry, which a line said once should not
            details = args[4] if len(args) == 5 else None
            self.lines.append(f"{args[0]}: {details}" if details else str(args[0]))
        else:
            self.lines.append(record.getMessage())
