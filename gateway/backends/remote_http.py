"""HTTP to one remote upstream: a pooled session, timeouts, and every failure as an
engine error.

However an upstream fails (a refused connection, a timeout, a 5xx, a body that is not
JSON, a stream cut short), the adapter raises BackendError, and BadRequestError for the
upstream's 400s, so the gateway's retry-before-output and error events work the same
for every server. Messages that reach clients name the backend, never the upstream's
address or its own error text for 5xx (which may carry tracebacks); the log has those.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NoReturn

import aiohttp
from yarl import URL

from engine_api.errors import BackendError, BadRequestError, PromptTooLongError

log = logging.getLogger("kvgate.remote")

POOL_LIMIT = 1024  # connections to one upstream; each stream in flight holds one
READ_BUFSIZE = 1 << 20  # a stream line (a chunk with top logprobs) may be long
MAX_ERROR_BODY = 64 * 1024  # read at most this much of an error response
MAX_MESSAGE_CHARS = 500  # an upstream's 400 message, passed on to the client
# bodies of these statuses are the client's fault (vLLM and FastAPI send 422 for schema)
BAD_REQUEST_STATUSES = (400, 413, 422)


class UpstreamUnreachable(BackendError):
    """No connection could be made: the replica is down, not just slow."""


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
    ) -> None:
        self.endpoint = endpoint
        self.label = label
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=POOL_LIMIT),
                headers=self._headers,
                read_bufsize=READ_BUFSIZE,
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
    ) -> aiohttp.ClientResponse:
        """The response, whatever its status (the caller reads or closes it)."""
        extra = {}
        if timeout_s is not None:  # a short call (health) or a long poll, not a stream
            extra["timeout"] = aiohttp.ClientTimeout(
                total=timeout_s, sock_connect=self.connect_timeout_s
            )
        try:
            return await self.session.request(method, url, json=body, params=params, **extra)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            log.debug("%s: cannot connect to %s: %s", self.label, url, e)  # the watch says
            raise UpstreamUnreachable(f"{self.label} is unreachable") from e
        except (aiohttp.ClientError, TimeoutError) as e:
            raise self.failure(url, e) from e

    async def json(
        self,
        method: str,
        url: str,
        body: Any = None,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """The JSON body of a 2xx answer; an engine error for anything else."""
        resp = await self.request(method, url, body, params, timeout_s)
        async with resp:
            if resp.status >= 300:
                await self.raise_for(resp)
            try:
                return json.loads(await resp.read())
            except (aiohttp.ClientError, TimeoutError) as e:
                raise self.failure(url, e) from e
            except ValueError as e:
                log.warning("%s: %s answered invalid JSON: %s", self.label, url, e)
                raise BackendError(f"{self.label} answered invalid JSON") from e

    def failure(self, url: str, e: BaseException) -> BackendError:
        """A failure while talking to the upstream (timeout, reset, cut stream)."""
        what = "timed out" if isinstance(e, TimeoutError) else "failed"
        log.warning("%s: %s %s: %r", self.label, url, what, e)
        return BackendError(f"{self.label} {what} ({type(e).__name__})")

    async def raise_for(self, resp: aiohttp.ClientResponse) -> NoReturn:
        """The engine error for a non-2xx answer: 400s are the client's (the upstream's
        message passes on; a worker's context error is rebuilt with its numbers)."""
        raw = b""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            while len(raw) < MAX_ERROR_BODY:
                part = await resp.content.read(MAX_ERROR_BODY - len(raw))
                if not part:
                    break
                raw += part
        error = _error_object(raw)
        if resp.status in BAD_REQUEST_STATUSES:
            sizes = [error.get(k) for k in ("prompt_tokens", "max_tokens", "context_length")]
            if error.get("code") == "context_length_exceeded" and all(
                isinstance(n, int) and not isinstance(n, bool) for n in sizes
            ):
                raise PromptTooLongError(*sizes)
            message = error.get("message")
            if not isinstance(message, str) or not message:
                message = f"{self.label} refused the request (HTTP {resp.status})"
            raise BadRequestError(message[:MAX_MESSAGE_CHARS])
        log.warning("%s: %s answered HTTP %d: %r", self.label, resp.url, resp.status, raw[:2000])
        if resp.status in (401, 403):
            raise BackendError(f"{self.label} refused the gateway's api_key (HTTP {resp.status})")
        raise BackendError(f"{self.label} answered HTTP {resp.status}")

    async def lines(self, resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The body's lines as they come; a cut or stalled stream is a BackendError."""
        try:
            async for line in resp.content:
                yield line
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise self.failure(str(resp.url), e) from e


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
    """The error an upstream reported inside a stream (`{"error": {...}}`), if any."""
    error = obj.get("error")
    if error is None:
        return None
    message = error.get("message") if isinstance(error, dict) else error
    log.warning("%s: error in a stream: %r", label, error)
    text = message[:MAX_MESSAGE_CHARS] if isinstance(message, str) else "an error"
    return BackendError(f"{label} failed mid-stream: {text}")
