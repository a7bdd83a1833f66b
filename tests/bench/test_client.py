"""The streaming client against a real local HTTP server that replays fixed SSE bytes,
cut at awkward places, so parsing and token accounting are checked byte for byte."""

import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.client import build_payload, send_request


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def chat_chunk(content=None, role=None, finish=None):
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


USAGE = {
    "choices": [],
    "usage": {
        "prompt_tokens": 11,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 8},
    },
}


async def serve_bytes(body: bytes, status: int = 200, pieces: int = 7):
    """A server that answers every POST with `body`, written in `pieces` uneven parts."""
    seen = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        seen["payload"] = await request.json()
        seen["auth"] = request.headers.get("Authorization")
        if status != 200:
            return web.json_response({"error": {"message": "slow down"}}, status=status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        cut = max(1, len(body) // pieces)
        for i in range(0, len(body), cut):
            await response.write(body[i : i + cut])
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_post("/v1/completions", handler)
    server = TestServer(app)
    await server.start_server()
    return server, seen


async def run(server, endpoint="chat", api_key="sk-test"):
    payload = build_payload(endpoint, "m", "hello", 3, 0.0, ignore_eos=True)
    async with aiohttp.ClientSession() as session:
        base = str(server.make_url("")).rstrip("/")
        return await send_request(session, base, endpoint, payload, api_key, tenant=1)


@pytest.mark.parametrize("pieces", [1, 5, 50])
async def test_chat_stream(pieces):
    body = (
        sse(chat_chunk(role="assistant", content=""))  # role only: not a token
        + sse(chat_chunk("Hel"))
        + b": keep-alive comment\n\n"
        + sse(chat_chunk("lo"))
        + sse(chat_chunk("!", finish="length"))
        + sse(USAGE)
        + sse(b"[DONE]")
    ).replace(b"\n\n", b"\r\n\r\n", 2)
    server, seen = await serve_bytes(body, pieces=pieces)
    try:
        out = await run(server)
    finally:
        await server.close()
    assert out.success, out.error
    assert out.generated_text == "Hello!"
    assert len(out.itl) == 2  # three text chunks
    assert out.latency == pytest.approx(out.ttft + sum(out.itl))
    assert (out.prompt_tokens, out.output_tokens, out.cached_tokens) == (11, 3, 8)
    assert out.tenant == 1
    assert seen["auth"] == "Bearer sk-test"
    assert seen["payload"]["stream_options"] == {"include_usage": True}
    assert seen["payload"]["messages"] == [{"role": "user", "content": "hello"}]
    assert seen["payload"]["ignore_eos"] is True


async def test_completions_stream_without_usage():
    text = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in "abcd"]
    body = b"".join(sse(c) for c in text) + sse(b"[DONE]")
    server, seen = await serve_bytes(body)
    try:
        out = await run(server, endpoint="completions", api_key=None)
    finally:
        await server.close()
    assert out.success and out.generated_text == "abcd"
    assert out.output_tokens is None and out.prompt_tokens is None  # never guessed
    assert seen["auth"] is None
    assert seen["payload"]["prompt"] == "hello"


async def test_http_error_is_a_failed_request():
    server, _ = await serve_bytes(b"", status=429)
    try:
        out = await run(server)
    finally:
        await server.close()
    assert not out.success
    assert out.error.startswith("HTTP 429") and "slow down" in out.error


async def test_stream_error_event_and_empty_stream():
    server, _ = await serve_bytes(sse({"error": {"message": "boom"}}))
    try:
        out = await run(server)
    finally:
        await server.close()
    assert not out.success and "boom" in out.error
    server, _ = await serve_bytes(sse(USAGE) + sse(b"[DONE]"))
    try:
        out = await run(server)
    finally:
        await server.close()
    assert not out.success and "no generated text" in out.error
