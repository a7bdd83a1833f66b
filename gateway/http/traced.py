"""The server span of each request an app traces, for the gateway's app and a worker's:
installed only when tracing is on, outside every other middleware, so the span covers
the whole response (a stream to its end) and sees the status the client got.

The probes and scrapes an app names (`/health`, `/metrics`, a worker's long polls) are
not traced: they are noise in a trace store, and frequent. The span is named as
OpenTelemetry's HTTP conventions name it, `METHOD route` (the route's template, never
the raw path a client may have filled with anything).
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from opentelemetry.trace import Status, StatusCode

from gateway.observe.tracing import Tracing

Middleware = Callable[..., object]


def traced_requests(
    tracing_of: Callable[[web.Application], Tracing | None], untraced: frozenset[str]
) -> Middleware:
    """A middleware that runs each request but `untraced` paths in a server span."""

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        tracing = tracing_of(request.app)
        if tracing is None or request.path in untraced:
            return await handler(request)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else None
        attributes = {"http.request.method": request.method}
        if route is not None:
            attributes["http.route"] = route
        name = f"{request.method} {route}" if route else request.method
        with tracing.server_span(name, request.headers, attributes) as span:
            response = await handler(request)
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:  # a server span's error (a 4xx is the client's)
                span.set_attribute("error.type", str(response.status))
                span.set_status(Status(StatusCode.ERROR))
            return response

    return middleware
