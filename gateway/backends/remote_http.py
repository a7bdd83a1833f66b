"""HTTP to one remote upstream: a pooled session, timeouts, and every failure as an
engine error.

However an upstream fails (a refused connection, a timeout, a 5xx, a body that is not
JSON, a stream cut short), the adapter raises BackendError, and BadRequestError for the
upstream's 400s, so the gateway's retry-before-output and error events work the same
for every server. Messages that reach clients name the backend and how it failed
(status, timeout), never the upstream's address or its own words, which may carry
tracebacks or what it was sent by others; the log has those.

An upstream is not trusted with the gateway's resources either: no redirect is followed
(a 3xx is a failure: it could point anywhere on the gateway's network), nothing is
decompressed (compression is not advertised, and a compressed body is refused: no
bombs), and what is read is bounded: a line, an error body, a JSON answer, a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NoReturn

import aiohttp
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from yarl import URL

from engine_api.errors import AdapterLoadError, BackendError, BadRequestError, PromptTooLongError

log = logging.getLogger("kvgate.remote")

POOL_LIMIT = 1024  # connections to one upstream; each stream in flight holds one
MAX_LINE_BYTES = 1 << 20  # a stream line (a chunk with 20 top logprobs is a few KiB)
MAX_ERROR_BODY = 64 * 1024  # read at most this much of an error response
MAX_RESPONSE_BYTES = 64 << 20  # a JSON answer or a whole stream (options.max_response_bytes)
YIELD_EVERY_LINES = 64  # the line reader gives the event loop a turn this often
MAX_RELAYED_CHARS = 500  # a kvgate worker's 400 message, passed on to the client
# bodies of these statuses are the client's fault (vLLM and FastAPI send 422 for schema)
BAD_REQUEST_STATUSES = (400, 413, 422)
# writes the W3C traceparent of the task's current span (none while tracing is off)
_W3C = TraceContextTextMapPropagator()


class UpstreamUnreachable(BackendError):
    """No connection could be made: the replica is down, not just slow."""


class UpstreamRefused(BackendError):
    """The upstream answered and refused the gateway (its api_key, or the model is not
    one it serves): the entry's configuration is wrong, waiting will not help."""


@dataclass(frozen=True)
class Endpoint:
    """Where an upstream is. base: its OpenAI `/v1` URL; root: the server root that
    holds /health, /tokenize and a kvgate worker's /kvgate/v1 routes."""

    base: str
    root: str
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        u = URL(url.rstrip("/"))
        if u.scheme not in ("http", "https") or not u.host:
            raise ValueError(f"url must be an http(s) URL of the upstream's /v1 base, got {url!r}")
        base = str(u)
        root = base.removesuffix("/v1")
        return cls(base, root, u.host, u.port or (443 if u.scheme == "https" else 80))


class UpstreamClient:
    """One upstream's connection pool. `label` names it in messages to clients."""

    def __init__(
        self,
        endpoint: Endpoint,
        label: str,
        api_key: str | None,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        self.endpoint = endpoint
        self.label = label
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_response_bytes = max_response_bytes
        self._headers = {"Accept-Encoding": "identity"}  # aiohttp would offer gzip
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=POOL_LIMIT),
                headers=self._headers,
                auto_decompress=False,
                # sock_read bounds the wait between bytes, so a long stream may run on;
                # waiting for a pooled connection is not bounded (it is a queue)
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s
                ),
            )

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise BackendError(f"{self.label} is not running")
        return self._session

    async def request(
        self,
        method: str,
        url: str,
        body: Any = None,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> aiohttp.ClientResponse:
        """The response, whatever its status (the caller reads or closes it); never a
        redirect followed, never a compressed body. `body`: JSON, or bytes of it."""
        headers = dict(headers or {})
        # a traced request's span (gateway/serving/traces.py): the upstream's spans join it
        _W3C.inject(headers)
        extra: dict[str, Any] = {"headers": headers}
        if timeout_s is not None:  # a short call (health) or a long poll, not a stream
            extra["timeout"] = aiohttp.ClientTimeout(
                total=timeout_s, sock_connect=self.connect_timeout_s
            )
        if isinstance(body, bytes):  # JSON the caller encoded (off the loop, when large)
            extra["data"] = body
            headers["Content-Type"] = "application/json"
        else:
            extra["json"] = body
        try:
            resp = await self.session.request(
                method, url, params=params, allow_redirects=False, **extra
            )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            log.debug("%s: cannot connect to %s: %s", self.label, url, e)  # the watch says
            raise UpstreamUnreachable(f"{self.label} is unreachable") from e
        except Exception as e:  # aiohttp's errors are not all ClientError (LineTooLong)
            raise self.failure(url, e) from e
        encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            resp.close()
            log.warning("%s: %s answered with Content-Encoding %r", self.label, url, encoding)
            raise BackendError(f"{self.label} sent a compressed body, which was not asked for")
        return resp

    async def json(
        self,
        method: str,
        url: str,
        body: Any = None,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        relay: bool = False,
    ) -> Any:
        """The JSON body of a 2xx answer; an engine error for anything else (`relay`:
        see raise_for)."""
        resp = await self.request(method, url, body, params, timeout_s)
        async with resp:
            if resp.status >= 300:
                await self.raise_for(resp, relay)
            raw = await self.read(resp, self.max_response_bytes)
        try:
            return json.loads(raw)
        except ValueError as e:
            log.warning("%s: %s answered invalid JSON: %s", self.label, url, e)
            raise BackendError(f"{self.label} answered invalid JSON") from e

    async def read(self, resp: aiohttp.ClientResponse, limit: int) -> bytes:
        """The body, or BackendError past `limit` bytes (nothing longer is held)."""
        raw = bytearray()
        try:
            while part := await resp.content.read(min(1 << 16, limit + 1 - len(raw))):
                raw += part
                if len(raw) > limit:
                    raise BackendError(f"{self.label} sent an answer over {limit} bytes")
        except BackendError:
            raise
        except Exception as e:
            raise self.failure(str(resp.url), e) from e
        return bytes(raw)

    def failure(self, url: str, e: BaseException) -> BackendError:
        """A failure while talking to the upstream (timeout, reset, cut stream)."""
        what = "timed out" if isinstance(e, TimeoutError) else "failed"
        log.warning("%s: %s %s: %r", self.label, url, what, e)
        return BackendError(f"{self.label} {what} ({type(e).__name__})")

    async def post_ok(self, url: str, body: Any) -> aiohttp.ClientResponse:
        """The 200 response of POST `url` (the caller reads or closes it); any other
        status is `raise_for`'s error, its response closed."""
        resp = await self.request("POST", url, body)
        if resp.status != 200:
            try:
                await self.raise_for(resp)
            finally:
                resp.close()
        return resp

    async def raise_for(self, resp: aiohttp.ClientResponse, relay: bool = False) -> NoReturn:
        """The engine error for a non-2xx answer: 400s are the client's, told by status
        alone (a context error is rebuilt with its numbers), or with `relay` (a kvgate
        worker: kvgate's own words about the request, e.g. which ids are outside the
        vocabulary) by its message, printable and cut short; a 3xx is a failure like a
        5xx (a redirect is never followed)."""
        raw = b""
        with contextlib.suppress(Exception):  # the status is the answer; the body is a hint
            raw = await self.read(resp, MAX_ERROR_BODY)
        error = _error_object(raw)
        if relay and (adapter_error := relayed_adapter_error(error)) is not None:
            raise adapter_error  # the registry logs it, once
        log.warning("%s: %s answered HTTP %d: %r", self.label, resp.url, resp.status, raw[:2000])
        if resp.status in BAD_REQUEST_STATUSES:
            sizes = [error.get(k) for k in ("prompt_tokens", "max_tokens", "context_length")]
            if error.get("code") == "context_length_exceeded" and all(
                isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**31 for n in sizes
            ):
                raise PromptTooLongError(*sizes)
            message = error.get("message")
            if relay and isinstance(message, str) and message.isprintable() and message:
                raise BadRequestError(message[:MAX_RELAYED_CHARS])
            raise BadRequestError(f"{self.label} refused the request (HTTP {resp.status})")
        if resp.status in (401, 403):
            raise UpstreamRefused(
                f"{self.label} refused the gateway's api_key (HTTP {resp.status})"
            )
        raise BackendError(f"{self.label} answered HTTP {resp.status}")

    async def lines(self, resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The body's lines as they come, each with its newline; a cut or stalled stream,
        a line over MAX_LINE_BYTES or a body over max_response_bytes is a BackendError.
        Each byte is scanned once, however the upstream splits its writes."""
        buf, total, scanned, lines = bytearray(), 0, 0, 0
        try:
            while part := await resp.content.readany():
                total += len(part)
                if total > self.max_response_bytes:
                    raise BackendError(
                        f"{self.label} sent a stream over {self.max_response_bytes} bytes"
                    )
                buf += part
                start = 0
                while (end := buf.find(b"\n", max(start, scanned))) != -1:
                    yield bytes(buf[start : end + 1])
                    start = end + 1
                    lines += 1
                    if lines % YIELD_EVERY_LINES == 0:
                        # a read may hold thousands of lines, and nothing below awaits
                        # while the client's socket takes them: let other requests run
                        await asyncio.sleep(0)
                del buf[:start]
                scanned = len(buf)
                if len(buf) > MAX_LINE_BYTES:
                    raise BackendError(f"{self.label} sent a line over {MAX_LINE_BYTES} bytes")
        except BackendError:
            raise
        except Exception as e:  # aiohttp's errors are not all ClientError
            raise self.failure(str(resp.url), e) from e
        if buf:
            yield bytes(buf)


def _error_object(raw: bytes) -> dict[str, Any]:
    """The `error` object of an OpenAI-shaped body ({} when there is none)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(body, dict):
        return {}
    if isinstance(body.get("error"), dict):
        return body["error"]
    # {"error": "..."}, vLLM's older flat {"object": "error", "message"}, FastAPI's detail
    for key in ("error", "message", "detail"):
        if isinstance(body.get(key), str):
            return {"message": body[key]}
    return {}


def relayed_adapter_error(error: Any) -> AdapterLoadError | None:
    """A kvgate worker's `adapter_load_failed` error object as the engine's error, its
    words cut short; None for any other."""
    if not isinstance(error, dict) or error.get("code") != AdapterLoadError.code:
        return None
    adapter, reason = error.get("adapter"), error.get("reason")
    if not isinstance(adapter, str) or not isinstance(reason, str):
        return None
    return AdapterLoadError(adapter[:MAX_RELAYED_CHARS], reason[:MAX_RELAYED_CHARS])


def parse_json_line(data: str | bytes, label: str) -> dict[str, Any]:
    """One streamed JSON object, or BackendError (an upstream's garbage is its fault)."""
    try:
        obj = json.loads(data)
    except ValueError as e:
        log.warning("%s: invalid JSON in a stream: %r", label, data[:200])
        raise BackendError(f"{label} sent invalid JSON") from e
    if not isinstance(obj, dict):
        raise BackendError(f"{label} sent a stream item that is not a JSON object")
    return obj


def stream_error(obj: dict[str, Any], label: str) -> BackendError | None:
    """The error an upstream reported inside a stream (`{"error": {...}}`), if any; its
    words go to the log, not to the client."""
    error = obj.get("error")
    if error is None:
        return None
    log.warning("%s: error in a stream: %r", label, str(error)[:2000])
    return BackendError(f"{label} failed mid-stream")


async def within_deadlines(
    stream: AsyncIterator[Any], label: str, first_token_timeout_s: float, request_timeout_s: float
) -> AsyncIterator[Any]:
    """`stream` within first_token_timeout_s to its first item and request_timeout_s in
    all (the read timeout alone is defeated by a byte now and then)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    end = start + request_timeout_s
    deadline = min(end, start + first_token_timeout_s)
    async with contextlib.aclosing(stream):
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    item = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                what, limit = ("in all", request_timeout_s)
                if deadline < end:
                    what, limit = ("to its first output", first_token_timeout_s)
                raise BackendError(f"{label} timed out ({limit:g} s {what})") from None
            deadline = end
            yield item
