"""A hostile OpenAI-compatible upstream, for `python -m studies.hostile_upstream` and the
tests: a third-party server (no /health, SSE completions, vLLM's /tokenize) on a
loopback port, served from a thread, that misbehaves on /v1/completions as `mode`
says. Each mode is one way a buggy or hostile server behind a `type = "remote"` entry
could hurt a gateway: lying usage, endless or oversized output, long lines, compression
bombs, redirects, trickles, its own words in errors.

It sends one token per word (" w0 w1 ..."), so its /tokenize counts words; it records
what it was sent and whether the gateway hung up on a completion, and runs beside it
an "internal" server nobody should reach (the target of its redirects).
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import json
import zlib
from typing import Any

from aiohttp import web

from studies.harness import ThreadedApps, free_port

SECRET = "SECRET-of-another-tenant"  # words an upstream puts in errors: never relayed


class Recorder:
    """A server on the gateway's network that nobody should reach: it counts hits."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.port = free_port()

    async def handle(self, request: web.Request) -> web.Response:
        self.hits.append(request.path + " " + (await request.text())[:200])
        return web.json_response({"choices": [{"text": SECRET, "finish_reason": "stop"}]})


class HostileUpstream(ThreadedApps):
    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = model
        self.mode = "ok"
        self.usage: dict[str, Any] = {}  # mode "ok": fields that replace the honest usage
        self.delay_s = 0.0  # between events in mode "ok"
        self.completions = 0
        self.hung_up = 0  # completions the gateway closed before their end
        self.health_redirect = False
        self.big_bytes = 8 << 20  # modes "big_json" and "no_blank": the answer's size
        self.bomb_bytes = 64 << 20  # mode "gzip": the size it inflates to
        self.tool_bytes = 4 << 20  # mode "tool_flood": the arguments' size at most
        self._bombs: dict[int, bytes] = {}
        self.recorder = Recorder()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def apps(self) -> list[tuple[web.Application, int]]:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/completions", self._completions)
        internal = web.Application()
        internal.router.add_route("*", "/{tail:.*}", self.recorder.handle)
        return [(app, self.port), (internal, self.recorder.port)]

    async def _health(self, request: web.Request) -> web.StreamResponse:
        if self.health_redirect:
            raise web.HTTPTemporaryRedirect(f"http://127.0.0.1:{self.recorder.port}/health")
        raise web.HTTPNotFound()  # as llama-cpp-python's server: /v1/models answers for it

    async def _models(self, request: web.Request) -> web.Response:
        entry = {"id": self.model, "object": "model", "max_model_len": 1 << 20}
        return web.json_response({"object": "list", "data": [entry]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
        words = text.split()
        return web.json_response({"tokens": [1000 + zlib.crc32(w.encode()) % 30000 for w in words]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.completions += 1
        handler = getattr(self, "_" + self.mode)
        if self.mode in ("redirect", "error_400", "gzip", "big_json"):
            return await handler(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await handler(body, resp, request)
        except (ConnectionResetError, asyncio.CancelledError):
            self.hung_up += 1  # the gateway closed the stream: as a real server, stop
        return resp

    # -- modes: the stream -------------------------------------------------------------

    async def _ok(self, body: dict, resp: web.StreamResponse, request: web.Request) -> None:
        """An honest stream of max_tokens words, with usage; `usage` replaces fields."""
        n = body["max_tokens"]
        for i in range(n):
            await _event(resp, _choice(f" w{i}", "length" if i == n - 1 else None))
            await asyncio.sleep(self.delay_s)
        usage = {
            "prompt_tokens": len(body["prompt"]),
            "completion_tokens": n,
            "total_tokens": len(body["prompt"]) + n,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        for key, value in self.usage.items():
            if key == "cached_tokens":
                usage["prompt_tokens_details"] = {"cached_tokens": value}
            else:
                usage[key] = value
        await _event(resp, {"choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")

    async def _packed(self, body: dict, resp: web.StreamResponse, request: web.Request) -> None:
        """All max_tokens words in one event, and a usage that says 1."""
        n = body["max_tokens"]
        text = "".join(f" w{i}" for i in range(n))
        await _event(resp, _choice(text, "length"))
        await _event(resp, {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
        await resp.write(b"data: [DONE]\n\n")

    async def _endless(self, body: dict, resp: web.StreamResponse, request: web.Request) -> None:
        i = 0
        while True:
            await _event(resp, _choice(f" w{i}", None))
            i += 1
            await asyncio.sleep(0.001)

    async def _overlong(self, body: dict, resp: web.StreamResponse, request: web.Request) -> None:
        """100 times max_tokens, then an end and a usage that owns up to it."""
        n = 100 * body["max_tokens"]
        for i in range(n):
            await _event(resp, _choice(f" w{i}", "length" if i == n - 1 else None))
        await _event(resp, {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}})
        await resp.write(b"data: [DONE]\n\n")

    async def _logprobs_flood(
        self, body: dict, resp: web.StreamResponse, request: web.Request
    ) -> None:
        """20,000 top logprobs a token, whatever was asked."""
        n = body["max_tokens"]
        for i in range(n):
            await resp.write(_flood_event(i, i == n - 1))
        await resp.write(b"data: [DONE]\n\n")

    async def _long_line(self, body: dict, resp: web.StreamResponse, request: web.Request) -> None:
        await _event(resp, _choice(" w0", None))
        await resp.write(b"data: " + b"x" * (3 << 20) + b"\n\n")

    async def _no_blank(self, body: dict, resp: web.StreamResponse, request: web.Request) -> None:
        """Data lines that never end their event: big_bytes of them."""
        line = b"data: " + b"y" * 1018 + b"\n"
        for _ in range(self.big_bytes // len(line)):
            await resp.write(line)

    async def _trickle(self, body: dict, resp: web.StreamResponse, request: web.Request) -> None:
        """A comment line now and then, never output: the read timeout never fires."""
        while True:
            await resp.write(b": ping\n")
            await asyncio.sleep(0.2)

    async def _trickle_after(
        self, body: dict, resp: web.StreamResponse, request: web.Request
    ) -> None:
        for i in range(3):
            await _event(resp, _choice(f" w{i}", None))
        await self._trickle(body, resp, request)

    async def _error_event(
        self, body: dict, resp: web.StreamResponse, request: web.Request
    ) -> None:
        for i in range(2):
            await _event(resp, _choice(f" w{i}", None))
        await _event(resp, {"error": {"message": SECRET, "type": "internal"}})

    async def _cut(self, body: dict, resp: web.StreamResponse, request: web.Request) -> None:
        for i in range(2):
            await _event(resp, _choice(f" w{i}", None))
        request.transport.close()

    async def _tool_flood(self, body: dict, resp: web.StreamResponse, request: web.Request) -> None:
        """A tool call whose arguments run to tool_bytes, in 256-byte events."""
        await _event(resp, _choice('<tool_call>{"name": "f", "arguments": {"a": "', None))
        piece = "z" * 256
        n = min(body["max_tokens"] - 2, self.tool_bytes // 256)
        for _ in range(n):
            await _event(resp, _choice(piece, None))
        await _event(resp, _choice('"}}</tool_call>', "stop"))
        await resp.write(b"data: [DONE]\n\n")

    # -- modes: the whole answer -------------------------------------------------------

    async def _redirect(self, body: dict) -> web.Response:
        target = f"http://127.0.0.1:{self.recorder.port}/v1/completions"
        return web.Response(status=307, headers={"Location": target})

    async def _error_400(self, body: dict) -> web.Response:
        return web.json_response({"error": {"message": SECRET, "type": "invalid"}}, status=400)

    async def _gzip(self, body: dict) -> web.Response:
        """A small body that inflates to bomb_bytes."""
        if self.bomb_bytes not in self._bombs:
            raw = b"data: " + b"0" * self.bomb_bytes
            self._bombs[self.bomb_bytes] = gzip.compress(raw, compresslevel=9)
        bomb = self._bombs[self.bomb_bytes]
        headers = {"Content-Encoding": "gzip", "Content-Type": "text/event-stream"}
        return web.Response(body=bomb, headers=headers)

    async def _big_json(self, body: dict) -> web.Response:
        """A non-streaming answer of big_bytes in short lines, not a stream at all."""
        return web.Response(text="w\n" * (self.big_bytes // 2), content_type="application/json")


def _choice(text: str, finish: str | None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


@functools.cache
def _flood_event(i: int, last: bool) -> bytes:
    """Token i's event of mode "logprobs_flood", encoded once. Made per request, its
    40,000 objects would set off full collections in the host process, which stop this
    server's thread until done: in the tests' process, whose heap by then is the whole
    suite's, for longer than the gateway waits between bytes."""
    event = _choice(f" w{i}", "length" if last else None)
    top = {f"t{j}": -1.0 - j / 1e5 for j in range(20_000)}
    event["choices"][0]["logprobs"] = {
        "tokens": [f" w{i}"],
        "token_logprobs": [-0.5],
        "top_logprobs": [top],
    }
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def _event(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
