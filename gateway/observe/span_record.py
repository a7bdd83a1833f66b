"""A traced request's spans as cheap records of kvgate's own, in place of OpenTelemetry
SDK spans.

An SDK span costs the gateway tens of microseconds from start to end (a lock, bounded
attribute maps, the span processors, a copy made for export), and a request has six of
them, all on the gateway's one event loop. A SpanRecord is a slotted object with a plain
attribute dict: ended, it goes to its sink (gateway/observe/span_export.py), which ships
it as a tuple of plain values to a process of its own that makes the SDK span and
exports it. It is an OpenTelemetry API Span, so it sits in OpenTelemetry's context like
one: the current span, whose W3C traceparent the remote adapter sends upstream.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

SAMPLED = TraceFlags(TraceFlags.SAMPLED)
# what an ended record is shipped as: name, trace id, span id, parent id (or None), whether
# the parent is remote, kind, start and end ns, attributes, status code, its description,
# events as (name, attributes, ns), trace state header (or None)
Shipped = tuple


class SpanRecord(trace.Span):
    """A sampled span, recorded in memory until it ends, then handed to `sink`."""

    __slots__ = (
        "name",
        "trace_id",
        "span_id",
        "parent_id",
        "parent_remote",
        "kind",
        "start_ns",
        "end_ns",
        "attributes",
        "status",
        "description",
        "events",
        "trace_state",
        "sink",
    )

    def __init__(
        self,
        name: str,
        trace_id: int,
        span_id: int,
        parent_id: int | None,
        parent_remote: bool,
        kind: SpanKind,
        attributes: Mapping[str, Any] | None,
        start_ns: int | None,
        trace_state: TraceState | None,
        sink: Callable[[SpanRecord], None],
    ) -> None:
        self.name = name
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_id = parent_id
        self.parent_remote = parent_remote
        self.kind = kind
        self.start_ns = time.time_ns() if start_ns is None else start_ns
        self.end_ns: int | None = None
        self.attributes = dict(attributes) if attributes else {}
        self.status = StatusCode.UNSET
        self.description: str | None = None
        self.events: list[tuple[str, dict[str, Any], int]] | None = None
        self.trace_state = trace_state
        self.sink = sink

    def child(
        self,
        name: str,
        span_id: int,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        start_ns: int | None = None,
    ) -> SpanRecord:
        """A span under this one, in its trace (sampled as it is)."""
        return SpanRecord(
            name,
            self.trace_id,
            span_id,
            self.span_id,
            False,
            kind,
            attributes,
            start_ns,
            self.trace_state,
            self.sink,
        )

    def get_span_context(self) -> SpanContext:
        return SpanContext(self.trace_id, self.span_id, False, SAMPLED, self.trace_state)

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.attributes.update(attributes)

    def add_event(
        self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None
    ) -> None:
        event = (name, dict(attributes or {}), timestamp or time.time_ns())
        self.events = [event] if self.events is None else [*self.events, event]

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        # its type only: a message may quote what the client sent
        self.add_event("exception", {"exception.type": type(exception).__name__}, timestamp)

    def update_name(self, name: str) -> None:
        self.name = name

    def is_recording(self) -> bool:
        return self.end_ns is None

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if isinstance(status, Status):
            status, description = status.status_code, status.description
        self.status, self.description = status, description

    def end(self, end_time: int | None = None) -> None:
        if self.end_ns is None:
            self.end_ns = time.time_ns() if end_time is None else end_time
            self.sink(self)

    def shipped(self) -> Shipped:
        """The ended span as plain values, for the exporting process."""
        state = self.trace_state.to_header() if self.trace_state else None
        return (
            self.name,
            self.trace_id,
            self.span_id,
            self.parent_id,
            self.parent_remote,
            self.kind.value,
            self.start_ns,
            self.end_ns,
            self.attributes,
            self.status.value,
            self.description,
            self.events,
            state,
        )
