"""How `python -m studies.hostile` sends its hostile requests and judges the answers.

Well-formed HTTP goes through aiohttp; malformed HTTP (a bad request line, conflicting
lengths, a request that stops halfway) is written by hand on a raw asyncio stream,
since no HTTP client will write it, and the answer is read while it is still being
written (a gateway may answer, and close, before taking the whole request).
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cache

import aiohttp

MODEL = "fake-model"
CHAT = "/v1/chat/completions"
_ERROR_FIELDS = {"message", "type", "param", "code"}


@dataclass
class Reply:
    """What came back. status None: no response (see `shape`: closed, held, error)."""

    status: int | None
    body: bytes = b""
    content_type: str = ""
    seconds: float = 0.0
    shape: str = ""  # set by `classify` unless the sender knows better
    note: str = ""


@dataclass
class Ctx:
    """What a case may use: the gateway's address, tenants' keys, the admin key."""

    url: str
    http: aiohttp.ClientSession
    keys: dict[str, str]  # tenant label -> API key
    tenant_ids: dict[str, str]  # tenant label -> tenant id
    admin_key: str
    bomb: bytes
    case_timeout_s: float
    slow_timeout_s: float  # the gateway's header and body timeouts, as started

    @property
    def hostport(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)


Send = Callable[[Ctx], Awaitable[Reply]]


@dataclass
class Case:
    kind: str
    name: str
    expect: tuple[int | None, ...]  # answers a correct gateway may give (None: it closes)
    send: Send


@cache
def gzip_zeros(mib: int) -> bytes:
    """A gzip member holding `mib` MiB of zeros (1 GiB packs into about 1 MB)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(1 << 20)
    return b"".join(z.compress(chunk) for _ in range(mib)) + z.flush()


def classify(reply: Reply) -> str:
    """openai: an OpenAI-shaped error; json / sse: a well-formed success body;
    non-json: anything else (a plain-text error page above all)."""
    if reply.status is None:
        return reply.shape or "closed"
    if reply.status < 400 and "text/event-stream" in reply.content_type:
        return "sse" if b"data: [DONE]" in reply.body else "non-json"
    try:
        data = json.loads(reply.body)
    except ValueError:
        return "non-json"
    if reply.status < 400:
        return "json"
    error = data.get("error") if isinstance(data, dict) else None
    ok = isinstance(error, dict) and set(error) >= _ERROR_FIELDS
    return "openai" if ok and isinstance(error["message"], str) else "non-json"


def _auth(ctx: Ctx, auth: str | None) -> dict[str, str]:
    if auth is None:
        return {}
    if auth == "admin":
        return {"Authorization": f"Bearer {ctx.admin_key}"}
    if auth in ctx.keys:
        return {"Authorization": f"Bearer {ctx.keys[auth]}"}
    return {"Authorization": auth}  # a literal header value


async def request(
    ctx: Ctx,
    method: str,
    path: str,
    body: object = None,
    *,
    data: bytes | None = None,
    auth: str | None = "main",
    headers: dict[str, str] | None = None,
) -> Reply:
    """One well-formed request through aiohttp; `data` is sent as is, `body` as JSON."""
    hdrs = _auth(ctx, auth) | (headers or {})
    if body is not None:
        data = json.dumps(body).encode()
    if data is not None:
        hdrs.setdefault("Content-Type", "application/json")
    t0 = time.perf_counter()
    try:
        async with ctx.http.request(
            method,
            ctx.url + path,
            data=data,
            headers=hdrs,
            timeout=aiohttp.ClientTimeout(total=ctx.case_timeout_s),
            auto_decompress=False,
        ) as r:
            raw = await r.read()
            return Reply(r.status, raw, r.headers.get("Content-Type", ""), _since(t0))
    except TimeoutError:
        return Reply(
            None,
            seconds=_since(t0),
            shape="held",
            note=f"no complete answer in {ctx.case_timeout_s:.0f} s",
        )
    except aiohttp.ClientError as e:
        return Reply(None, seconds=_since(t0), shape="error", note=type(e).__name__)


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def call(method: str, path: str, body: object = None, **kw) -> Send:
    return lambda ctx: request(ctx, method, path, body, **kw)


def post(path: str, body: object = None, **kw) -> Send:
    return call("POST", path, body, **kw)


def raw_http(head: str, body: bytes = b"", auth: str | None = "main") -> Callable[[Ctx], bytes]:
    """A request's bytes, written by hand: `head` is the request line and any headers."""

    def build(ctx: Ctx) -> bytes:
        lines = [head, f"Host: {ctx.url.removeprefix('http://')}", "Connection: close"]
        lines += [f"{k}: {v}" for k, v in _auth(ctx, auth).items()]
        return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body

    return build


def raw(payload: Callable[[Ctx], bytes] | bytes, slow: bool = False) -> Send:
    """Write bytes on a fresh connection while reading whatever answer comes back.
    `slow`: the request never completes; wait out the gateway's own timeout for it."""

    async def send(ctx: Ctx) -> Reply:
        data = payload(ctx) if callable(payload) else payload
        wait = ctx.slow_timeout_s + 5 if slow else ctx.case_timeout_s
        return await raw_exchange(*ctx.hostport, data, wait)

    return send


async def raw_exchange(host: str, port: int, data: bytes, wait_s: float) -> Reply:
    reader, writer = await asyncio.open_connection(host, port)
    t0 = time.perf_counter()

    async def write() -> None:
        try:
            writer.write(data)
            await writer.drain()
        except OSError:
            pass  # the server may close before taking it all; its answer still counts

    writing = asyncio.create_task(write())
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), wait_s)
        status = int(head.split(b" ", 2)[1])
        fields = dict(
            line.decode("latin-1").lower().split(": ", 1)
            for line in head.split(b"\r\n")[1:]
            if b": " in line
        )
        if "content-length" in fields:
            body = await asyncio.wait_for(reader.readexactly(int(fields["content-length"])), 5)
        else:
            body = await asyncio.wait_for(reader.read(), 5)
        return Reply(status, body, fields.get("content-type", ""), _since(t0))
    except asyncio.IncompleteReadError as e:
        shape = "closed" if not e.partial else "non-json"
        return Reply(
            None,
            e.partial,
            seconds=_since(t0),
            shape=shape,
            note=f"closed after {_since(t0):.1f} s without an answer",
        )
    except TimeoutError:
        return Reply(
            None,
            seconds=_since(t0),
            shape="held",
            note=f"no answer in {wait_s:.0f} s; the connection stays open",
        )
    except (ConnectionError, ValueError, IndexError) as e:
        return Reply(None, seconds=_since(t0), shape="error", note=type(e).__name__)
    finally:
        writing.cancel()
        writer.close()


def chat(**over: object) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
    } | over


def chat_text(extra: str) -> bytes:
    """A chat body as JSON text with one more member that json.dumps cannot write."""
    return (json.dumps(chat())[:-1] + ", " + extra + "}").encode()


def on_tenant(method: str, template: str, body: object, auth: str = "admin") -> Send:
    """A request on the main tenant's own admin paths (`template` holds {id})."""
    return lambda ctx: request(
        ctx, method, template.format(id=ctx.tenant_ids["main"]), body, auth=auth
    )


def user_chat(content: object) -> dict:
    return chat(messages=[{"role": "user", "content": content}])


def judge(expect: tuple[int | None, ...], status: int | None, shape: str) -> bool:
    """Whether an answer is one a correct gateway may give: an expected status, and for
    an error, an OpenAI-shaped body."""
    if status not in expect:
        return False
    if status is None:
        return shape == "closed"
    return shape == "openai" if status >= 400 else shape in ("json", "sse")


def summarize(rows: list[dict]) -> dict:
    """Part 1's figures: cases tried, by kind, and how many got a bad answer."""
    kinds: dict[str, int] = {}
    for row in rows:
        kinds[row["kind"]] = kinds.get(row["kind"], 0) + 1
    return {
        "tried": len(rows),
        "kinds": kinds,
        "5xx": sum(1 for r in rows if (r["status"] or 0) >= 500),
        "non_json_errors": sum(
            1 for r in rows if (r["status"] or 0) >= 400 and r["shape"] != "openai"
        ),
        "no_answer": sum(1 for r in rows if r["status"] is None and r["shape"] != "closed"),
        "unexpected": sum(1 for r in rows if not r["expected"]),
        "tracebacks": sum(r["tracebacks"] for r in rows),
        "cases": rows,
    }
