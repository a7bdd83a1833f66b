"""Small helpers shared by the HTTP handlers.

`parse_body` is the one place a request body is read: handlers authenticate first, so
an unauthenticated client never has its body parsed, let alone decompressed. The server
runs with aiohttp's automatic decompression off (gateway/http/server.py): gzip and
deflate bodies are inflated here, and never past `max_body_bytes`.

Answers are encoded by orjson (compact, UTF-8 as it is): 5x faster than pydantic_core's
`to_json` on a completion's body and 3x on a stream's chunk, which is 4x faster than the
json module (docs/PERF.md, issue 53); what orjson does not take (a pydantic model, an
integer past 64 bits, a key that is not a string) goes through `to_json`. The bytes go to
aiohttp as they are, which spares it a string payload per response.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json, to_jsonable_python

from gateway.config import Settings
from gateway.http.errors import ApiError, is_ollama
from gateway.http.validation import described

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
# The app's settings (body limit and timeout): the gateway's and a worker's app set it.
SETTINGS = web.AppKey("settings", Settings)

LARGE_BODY_BYTES = 256 * 1024  # past this, inflating and parsing leave the event loop
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


async def parse_body(request: web.Request, model: type[M]) -> M:
    """The request's JSON body as `model`; 4xx as an ApiError for anything else."""
    settings = request.app[SETTINGS]
    _check_content_type(request)
    encoding = _content_encoding(request)
    if request.content_length is not None and request.content_length > settings.max_body_bytes:
        raise _too_large(settings.max_body_bytes)
    try:
        raw = await _read(request, settings.body_timeout_s)
    except TimeoutError:
        raise ApiError(
            408, f"The request body did not arrive within {settings.body_timeout_s:g} s."
        ) from None
    except (web.RequestPayloadError, HttpProcessingError):
        raise ApiError(400, "The request body is malformed (its chunked encoding).") from None
    if encoding and raw:
        # zlib lets go of the GIL while it inflates: a worker thread keeps the loop free
        # for any body that may inflate past the threshold (8x is ordinary for JSON)
        if len(raw) * 8 > LARGE_BODY_BYTES:
            raw = await asyncio.to_thread(inflate, raw, encoding, settings.max_body_bytes)
        else:
            raw = inflate(raw, encoding, settings.max_body_bytes)
    if not raw:
        raise ApiError(400, "The request body is empty; expected a JSON object.")
    if len(raw) > LARGE_BODY_BYTES:  # parsing megabytes takes milliseconds others would wait
        return await asyncio.to_thread(_validate, raw, model)
    return _validate(raw, model)


async def _read(request: web.Request, timeout_s: float) -> bytes:
    """The body, its wait bounded by `timeout_s`; no timer for a body that came whole with
    its headers, as a small one does (aiohttp raises 413 past client_max_size)."""
    if request.content.is_eof():
        return await request.read()
    async with asyncio.timeout(timeout_s):
        return await request.read()


def _check_content_type(request: web.Request) -> None:
    # No Content-Type at all is taken as JSON: some clients leave it out, and a body
    # that is not JSON still gets a 400 from the parser.
    if hdrs.CONTENT_TYPE not in request.headers:
        return
    ctype = request.content_type
    # Ollama reads every body as JSON: its documented `curl -d '{...}'` sends form data
    if ctype == "application/x-www-form-urlencoded" and is_ollama(request.path):
        return
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise ApiError(
            415,
            f"Content-Type {ctype[:100]!r} is not supported; send the body as "
            "application/json (curl: -H 'Content-Type: application/json').",
            code="unsupported_media_type",
        )


def _content_encoding(request: web.Request) -> str | None:
    value = request.headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
    if value in ("", "identity"):
        return None
    if value not in _WBITS:
        raise ApiError(
            415,
            f"Content-Encoding {value[:100]!r} is not supported; use gzip, deflate or none.",
            code="unsupported_content_encoding",
        )
    return value


def inflate(raw: bytes, encoding: str, limit: int) -> bytes:
    """`raw` decompressed; 413 past `limit` bytes. zlib stops after limit + 1 bytes of
    output, so a decompression bomb costs no more than an honest body of `limit` bytes."""
    wbits = _WBITS[encoding]
    if encoding == "deflate" and not _zlib_header(raw):
        wbits = -zlib.MAX_WBITS  # raw deflate: what some clients send as "deflate"
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(raw, limit + 1)
    except zlib.error:
        raise ApiError(400, f"The body is not valid {encoding} data.") from None
    if len(out) > limit:
        raise _too_large(limit, "decompressed ")
    if not inflater.eof or inflater.unused_data:
        raise ApiError(400, f"The body is not one complete {encoding} stream.")
    return out


def _zlib_header(raw: bytes) -> bool:
    return len(raw) >= 2 and (raw[0] & 0x0F) == 8 and ((raw[0] << 8) | raw[1]) % 31 == 0


def _too_large(limit: int, what: str = "") -> ApiError:
    return ApiError(
        413, f"The {what}request body is larger than {limit} bytes.", code="request_too_large"
    )


def _validate(raw: bytes, model: type[M]) -> M:
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise ApiError(400, f"The body is not valid JSON: {first['msg']}") from None
        raise invalid(e, _parsed(raw)) from None


def invalid(error: ValidationError, data: Any) -> ApiError:
    """The 400 for a body or query (`data`) that `error` refused, in the API's words."""
    message, param = described(error, data)
    return ApiError(400, message, param=param)


def _parsed(raw: bytes) -> Any:
    """The body once more, to tell its fields from pydantic's labels (only for an error)."""
    try:
        return json.loads(raw)
    except ValueError:
        return None


def json_bytes(data: Any) -> bytes:
    """`data` as compact JSON (NaN and infinities as null)."""
    try:
        return orjson.dumps(data, default=to_jsonable_python)
    except TypeError:
        return to_json(data)


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None):
    return web.Response(
        body=json_bytes(data), status=status, content_type="application/json", headers=headers
    )


def sse(data: Any) -> bytes:
    return b"data: " + json_bytes(data) + b"\n\n"


async def off_loop_if(large: bool, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, in a worker thread when the work is large (a big answer's encoding,
    a held tool call's parse): on the loop it would stall every other request."""
    return await asyncio.to_thread(fn, *args) if large else fn(*args)
