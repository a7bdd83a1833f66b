"""The gateway's HTTP transport: aiohttp's server, hardened against slow and idle clients.

aiohttp waits for request headers without a deadline of its own, takes any number of
connections and answers parser errors in plain text. GatewayProtocol adds a deadline
on headers (`header_timeout_s`), a cap on open connections (`max_connections`) and
OpenAI-shaped parser errors. GatewayRunner is aiohttp's AppRunner serving with it, so
sites, the app's start-up and graceful shutdown stay aiohttp's own. Only aiohttp's
public methods are overridden, plus the runner hooks `_make_server`/`_make_runner`
that its own subclasses use; no private attribute is read.

A connection past the cap is accepted, answered 503 with an OpenAI-shaped body and
closed: a client learns why at once, rather than waiting in the kernel's backlog for a
connect timeout with no explanation.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any, cast

from aiohttp import web
from aiohttp.test_utils import TestServer
from aiohttp.web_protocol import RequestHandler

from gateway.config import Settings
from gateway.http.errors import error_body

REFUSAL_LINGER_S = 1.0  # how long a refused client may still send before the close


def handler_kwargs(settings: Settings) -> dict[str, Any]:
    """aiohttp's per-connection options: the same for every server the gateway runs in."""
    return {
        "auto_decompress": False,  # parse_body inflates, after authentication, with a cap
        "keepalive_timeout": settings.keepalive_timeout_s,
    }


class GatewayProtocol(RequestHandler):
    """One client connection: aiohttp's handler with a header deadline and JSON errors.

    The deadline runs from the connection's start, and on a kept-alive connection from
    the first byte of the next request (the idle time before it is the keep-alive
    timeout's), until the request's headers are complete. One timer a connection, not one
    a request: a request's start only notes the time, and a timer that finds the wait it
    was armed for over arms itself again for the wait in progress, if any (a timer armed
    and cancelled a request cost about 1.5 us; docs/PERF.md, issue 53).
    """

    __slots__ = (
        "_server",
        "_event_loop",
        "_header_timer",
        "_header_wait_since",
        "_awaiting_headers",
        "_counted",
    )

    def __init__(self, server: GatewayServer, *, loop: asyncio.AbstractEventLoop, **kwargs: Any):
        super().__init__(server, loop=loop, **kwargs)
        self._server = server
        self._event_loop = loop
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_wait_since: float | None = None  # loop time of this wait's first byte
        self._awaiting_headers = True
        self._counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._server
        if server.open_connections >= server.settings.max_connections:
            transport.set_protocol(_Refusal(cast(asyncio.Transport, transport), self._event_loop))
            return
        server.open_connections += 1
        self._counted = True
        super().connection_made(transport)
        self._headers_awaited()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_header_timer()
        if self._counted:
            self._counted = False
            self._server.open_connections -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_headers and self._header_wait_since is None and data:
            self._headers_awaited()  # the first byte of a request on a kept-alive connection
        super().data_received(data)

    def headers_received(self) -> None:
        """A request's headers are complete: its body has `body_timeout_s` (parse_body)."""
        self._awaiting_headers = False
        self._header_wait_since = None  # the timer, if armed, finds no wait and lapses

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._awaiting_headers = True

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Parser errors (400) and handler failures outside the app's middleware."""
        if status < 500:
            # a malformed request is the client's doing: one line, no traceback, so that
            # a client cannot fill the log with them
            self.logger.info("malformed request from %s: %s", request.remote, exc)
            if request.writer.output_size > 0:
                raise ConnectionError("a response was already begun on this connection")
        else:
            super().handle_error(request, status, exc, message)  # logs; raises if a reply began
        if status == 400 and message:
            # one line, without the caret aiohttp draws under the bad byte
            text = "Malformed HTTP request: " + " ".join(message.split()).removesuffix(" ^")
        else:
            text = HTTPStatus(status).phrase + "."
        resp = web.Response(
            status=status,
            body=json.dumps(error_body(status, text)),
            content_type="application/json",
        )
        resp.force_close()
        return resp

    def _headers_awaited(self) -> None:
        """A wait for headers begins now; a timer is armed unless one already is (for an
        earlier wait, so it fires sooner than this one's deadline)."""
        timeout = self._server.settings.header_timeout_s
        if timeout > 0:
            self._header_wait_since = self._event_loop.time()
            if self._header_timer is None:
                self._header_timer = self._event_loop.call_later(timeout, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        since = self._header_wait_since
        if not self._awaiting_headers or since is None:
            return  # the wait it was armed for is over, and no other has begun
        left = since + self._server.settings.header_timeout_s - self._event_loop.time()
        if left > 0:  # armed for an earlier wait: this one's deadline is later
            self._header_timer = self._event_loop.call_later(left, self._headers_late)
        else:
            self.force_close()


class _Refusal(asyncio.Protocol):
    """A connection past `max_connections`: a 503, then the close. The write side shuts
    first and what the client still sends is read and dropped for a moment, so that a
    client busy sending its request reads the 503 instead of a connection reset."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        transport.write(_REFUSAL)
        if transport.can_write_eof():
            transport.write_eof()
        self._close_timer = loop.call_later(REFUSAL_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the transport closes

    def connection_lost(self, exc: BaseException | None) -> None:
        self._close_timer.cancel()


def _refusal_response() -> bytes:
    body = json.dumps(
        error_body(503, "Too many open connections; retry shortly.", code="too_many_connections")
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


_REFUSAL = _refusal_response()


class GatewayServer(web.Server):
    """aiohttp's Server (it keeps the connections, for graceful shutdown), making
    GatewayProtocols and counting the open ones."""

    def __init__(
        self,
        handler: Any,
        settings: Settings,
        *,
        request_factory: Any,
        handler_cancellation: bool = False,
        **protocol_kwargs: Any,
    ) -> None:
        super().__init__(
            handler,
            request_factory=self._request_started,
            handler_cancellation=handler_cancellation,
            **protocol_kwargs,
        )
        self.settings = settings
        self.open_connections = 0
        self._app_request_factory = request_factory
        self._protocol_kwargs = protocol_kwargs
        self._event_loop = asyncio.get_running_loop()

    def __call__(self) -> GatewayProtocol:
        return GatewayProtocol(self, loop=self._event_loop, **self._protocol_kwargs)

    def _request_started(self, message, payload, protocol, writer, task) -> web.BaseRequest:
        # aiohttp makes the request object once a request's headers are parsed
        protocol.headers_received()
        return self._app_request_factory(message, payload, protocol, writer, task)


class GatewayRunner(web.AppRunner):
    """aiohttp's AppRunner with the gateway's transport: use it with any aiohttp site."""

    def __init__(
        self,
        app: web.Application,
        settings: Settings,
        *,
        handler_cancellation: bool = True,
        shutdown_timeout: float = 60.0,
        **kwargs: Any,
    ) -> None:
        # handler_cancellation: a client that hangs up cancels its handler, which aborts
        # the request in the backend instead of generating for nobody.
        # shutdown_timeout: how long `cleanup` waits for open requests (aiohttp's 60 s;
        # after a drain (gateway/http/drain.py) only connections that never end are left)
        self._settings = settings
        self._cancellation = handler_cancellation
        self._protocol_kwargs = handler_kwargs(settings) | kwargs
        super().__init__(
            app,
            handler_cancellation=handler_cancellation,
            shutdown_timeout=shutdown_timeout,
            **self._protocol_kwargs,
        )

    async def _make_server(self) -> web.Server:
        # aiohttp's own step (BaseRunner's hook for subclasses): it starts the app and
        # names the app's handler and request factory, which our Server then serves.
        plain = await super()._make_server()
        return GatewayServer(
            plain.request_handler,
            self._settings,
            request_factory=plain.request_factory,
            handler_cancellation=self._cancellation,
            **self._protocol_kwargs,
        )


class GatewayTestServer(TestServer):
    """aiohttp's in-process TestServer, serving with the gateway's transport."""

    def __init__(self, app: web.Application, settings: Settings, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.settings = settings

    async def _make_runner(self, **kwargs: Any) -> web.AppRunner:
        return GatewayRunner(self.app, self.settings, **kwargs)
