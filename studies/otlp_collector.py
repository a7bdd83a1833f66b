"""A stand-in for an OpenTelemetry collector: an OTLP/HTTP (protobuf) receiver and an
OTLP/gRPC one that decode every ExportTraceServiceRequest they get and keep its spans.

    python -m studies.otlp_collector    (prints its URL, serves until SIGTERM; GET /count)

The trace tests (tests/gateway/test_tracing.py) check what a real `kvgate serve` and
`kvgate worker` export through the real OTLP exporters, and studies/tracing_overhead.py
gives the gateway somewhere to send its spans while it is measured: a collector that
decodes them, as a real one does, not a socket that drops them. The raw bodies are kept
too, so a test can look for a secret in everything that was sent, not only in the
fields it thought of.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from studies.harness import ThreadedApps

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_id: str  # "" for a root
    name: str
    kind: str
    attributes: dict[str, Any]
    error: bool
    start_ns: int
    end_ns: int


class Spans:
    """What a receiver has decoded so far, shared with the thread it runs in."""

    def __init__(self, keep: bool = True) -> None:
        self._lock = threading.Lock()
        self.keep = keep  # False: count them only (a study's millions)
        self.received = 0
        self.spans: list[ReceivedSpan] = []
        self.bodies: list[bytes] = []

    def add(self, body: bytes, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        if not self.keep:  # parsed (the decoding a collector does), counted, dropped
            n = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
            with self._lock:
                self.received += n
            return
        spans = decode(request)
        with self._lock:
            self.received += len(spans)
            self.bodies.append(body)
            self.spans.extend(spans)

    def count(self) -> int:
        with self._lock:
            return self.received

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 20
    ) -> list[ReceivedSpan]:
        """The spans once `done` holds for them (they come in batches); AssertionError
        with what came after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({s.name for s in spans})
                raise AssertionError(f"{len(spans)} spans came, not the ones expected: {names}")
            time.sleep(0.05)


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                out.append(
                    ReceivedSpan(
                        service=str(resource.get("service.name", "")),
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        name=s.name,
                        kind=KINDS.get(s.kind, str(s.kind)),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        error=s.status.code == 2,  # STATUS_CODE_ERROR
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                    )
                )
    return out


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return None if which is None else getattr(v, which)


class HttpCollector(ThreadedApps, Spans):
    """OTLP over HTTP with protobuf bodies at `url` (POST /v1/traces)."""

    def __init__(self, keep: bool = True) -> None:
        ThreadedApps.__init__(self)
        Spans.__init__(self, keep)
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"

    def apps(self) -> list[tuple[web.Application, int]]:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._traces)
        app.router.add_get("/count", self._count)
        return [(app, self.port)]

    async def _count(self, request: web.Request) -> web.Response:
        return web.json_response({"spans": self.count()})

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        message = trace_service_pb2.ExportTraceServiceRequest()
        message.ParseFromString(body)
        self.add(body, message)
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")


class GrpcCollector(Spans, trace_service_pb2_grpc.TraceServiceServicer):
    """OTLP over gRPC at `endpoint` (plaintext, as `http://host:port` tells the exporter)."""

    def __init__(self) -> None:
        Spans.__init__(self)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"

    def Export(self, request, context):  # noqa: N802 (the service's method name)
        self.add(request.SerializeToString(), request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def __enter__(self) -> GrpcCollector:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)


def main() -> None:
    """The HTTP receiver in a process of its own (studies/tracing_overhead.py): its
    decoding must not share the load generator's interpreter."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with HttpCollector(keep=False) as collector:
        print(collector.url, flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
