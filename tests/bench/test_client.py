"""The streaming client against a real local HTTP server that replays fixed SSE bytes,
cut at awkward places, so parsing and token accounting are checked byte for byte."""

import asyncio
import json
import re

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
    assert out.finish_reason == "length"  # the usage chunk after it has no choice
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
    assert out.success and out.generated_text == "abcd" and out.finish_reason is None
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


async def test_stream_error_event_fails():
    server, _ = await serve_bytes(sse({"error": {"message": "boom"}}))
    try:
        out = await run(server)
    finally:
        await server.close()
    assert not out.success and "boom" in out.error


def completion_chunk(text="", finish=None):
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


SILENT_USAGE = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}


@pytest.mark.parametrize(
    ("endpoint", "chunks"),
    [
        # stopped at once: one chunk, the role (chat) and the finish, no text
        ("chat", [chat_chunk(role="assistant", content="", finish="stop")]),
        ("completions", [completion_chunk(finish="stop")]),
        # special tokens only: a chunk each, none with text
        ("chat", [chat_chunk(role="assistant", content="")] + [chat_chunk()] * 4),
        ("completions", [completion_chunk()] * 4 + [completion_chunk(finish="length")]),
        ("completions", []),  # nothing but the usage
    ],
)
async def test_a_reply_without_text_is_a_success(endpoint, chunks):
    """As in vLLM's client: a reply that ends with no text is counted, with its usage."""
    body = b"".join(sse(c) for c in chunks) + sse(SILENT_USAGE) + sse(b"[DONE]")
    server, _ = await serve_bytes(body, pieces=1)
    try:
        out = await run(server, endpoint=endpoint)
    finally:
        await server.close()
    assert out.success, out.error
    assert out.generated_text == "" and out.itl == []
    assert (out.prompt_tokens, out.output_tokens) == (9, 1)
    assert 0 < out.ttft <= out.latency


async def test_a_stream_cut_before_the_reply_ended_fails():
    server, _ = await serve_bytes(sse(completion_chunk("a")) + sse(completion_chunk("b")))
    try:
        out = await run(server, endpoint="completions")
    finally:
        await server.close()
    assert not out.success and "ended before the reply did" in out.error


async def _dropping_server(drop_all: bool) -> tuple[asyncio.Server, str]:
    """A raw HTTP server that answers the first request of each connection with a
    kept-alive SSE reply and closes the connection on the next one unanswered, as
    llama-server does with a connection it has timed out (or, `drop_all`, every one)."""
    body = sse(chat_chunk("hi")) + sse(USAGE) + sse(b"[DONE]")
    reply = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
            await reader.readexactly(length)
            if served or drop_all:
                writer.close()
                return
            writer.write(reply)
            await writer.drain()
            served += 1

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_a_request_on_a_connection_the_server_closed_is_sent_again():
    server, base = await _dropping_server(drop_all=False)
    payload = build_payload("chat", "m", "hello", 3, 0.0, ignore_eos=True)
    try:
        async with aiohttp.ClientSession() as session:
            outs = [await send_request(session, base, "chat", payload, None) for _ in range(3)]
    finally:
        server.close()
    assert [o.error for o in outs] == ["", "", ""]
    assert all(o.success and o.generated_text == "hi" for o in outs)


async def test_a_server_that_drops_every_request_fails_it():
    server, base = await _dropping_server(drop_all=True)
    payload = build_payload("chat", "m", "hello", 3, 0.0, ignore_eos=True)
    try:
        async with aiohttp.ClientSession() as session:
            out = await send_request(session, base, "chat", payload, None)
    finally:
        server.close()
    assert not out.success and "ServerDisconnected" in out.error
