"""A `remote` entry from its URL alone (issue 32, section 4): real servers behind a real
`kvgate serve`, the `openai` client as the caller.

- llama-cpp-python's server and llama.cpp's llama-server, on the default GGUF: the
  model id and what each tells of its context and tokenizer are discovered and printed
  at start; chats and completions are served with exact request quotas (rpm: the N+1th
  is a 429) and a usage row each.
- An upstream that tells nothing (a tiny server speaking only /v1/models and
  /v1/chat/completions): served anyway, the quota reserved from the prompt's UTF-8
  bytes and settled from the upstream's usage.
- An upstream down at start and an entry that cannot start: /health names them, and
  their models answer a 503 `backend_unavailable` with the reason, not a 404.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path

import httpx
import openai
import pytest
from aiohttp import web

from engine_api.errors import BadRequestError
from gateway.backends.default_model import default_model_path
from gateway.backends.fake import FakeBackend
from gateway.backends.remote_text import (
    CHAT_MARK,
    MARGIN,
    TEXT_MARK,
    is_text_bound,
    marked,
    text_bound,
)
from gateway.backends.remote_tokenizer import load_tokenizer
from tests.conftest import LiveGateway, away_from_minute_boundary, free_port, start_gateway
from tests.gateway.conftest import fake_backends
from tests.gateway.upstream_servers import (
    llama_cpp_python_server,
    llama_cpp_server,
    llama_server_binary,
)

UPSTREAM_ID = "the-upstream's-name"  # what the upstream calls its model
MODEL = "gemma"  # what clients call it
QUESTION = [{"role": "user", "content": "Say hello."}]


def url_only(url: str, model: str = MODEL, name: str = "up", **options: object) -> str:
    """A remote entry with its URL alone (and the options a test adds)."""
    lines = ["[[backends]]", f'name = "{name}"', 'type = "remote"', f'model = "{model}"']
    opts = {"urls": [url]} | options
    return "\n".join(
        [*lines, "[backends.options]", *(f"{k} = {json.dumps(v)}" for k, v in opts.items())]
    )


def usage_rows(tmp_path: Path, tenant_id: str) -> list[tuple]:
    db = sqlite3.connect(tmp_path / "kvgate.db")
    return db.execute(
        "SELECT prompt_tokens, completion_tokens, status FROM usage_records "
        "WHERE tenant_id = ? ORDER BY id",
        (tenant_id,),
    ).fetchall()


def wait_for_rows(tmp_path: Path, tenant_id: str, n: int) -> list[tuple]:
    deadline = time.monotonic() + 30
    while len(rows := usage_rows(tmp_path, tenant_id)) < n:
        assert time.monotonic() < deadline, rows
        time.sleep(0.1)
    return rows


def serves_with_exact_quotas(gw: LiveGateway, tmp_path: Path) -> list[tuple]:
    """A streamed chat and a completion within rpm = 2, the third a 429; the usage rows,
    each as the client was told."""
    tenant, key = gw.tenant_key("url-only", rpm=2)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    asyncio.run(away_from_minute_boundary(30))  # rpm counts per UTC minute
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    chat = chunks[-1].usage
    comp = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert comp.choices[0].text and 0 < comp.usage.completion_tokens <= 5
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="a", max_tokens=1)
    rows = wait_for_rows(tmp_path, tenant["id"], 2)
    assert rows == [
        (chat.prompt_tokens, chat.completion_tokens, 200),
        (comp.usage.prompt_tokens, comp.usage.completion_tokens, 200),
    ]
    return rows


def test_llama_cpp_python_server_from_its_url_alone(tmp_path):
    with llama_cpp_python_server(tmp_path, UPSTREAM_ID, chat_format="gemma") as url:
        gw = start_gateway(tmp_path, config=url_only(url + "/v1"), timeout=120)
        try:
            log = gw.log.read_text()
            # it tells its model id and a tokenizer (/extras/tokenize), no context length
            assert f"model {UPSTREAM_ID!r} (discovered)" in log, log
            assert "context length 8192 (assumed" in log, log
            assert "output counted by its /extras/tokenize" in log, log
            (chat_prompt, _, _), (comp_prompt, _, _) = serves_with_exact_quotas(gw, tmp_path)
            # it sends no usage when streaming: a chat (its template is its own) stays
            # billed at its bound; a text prompt at its /extras/tokenize's count (BOS too),
            # what it says it prefilled when it does send usage
            bound = MARGIN + len(json.dumps(QUESTION, separators=(",", ":")).encode())
            assert chat_prompt == bound
            prompt = "The capital of France is"
            counted = httpx.post(url + "/extras/tokenize", json={"input": prompt}).json()
            direct = httpx.post(
                url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60
            ).json()
            assert comp_prompt == len(counted["tokens"]) == direct["usage"]["prompt_tokens"]
            assert comp_prompt < MARGIN + len(prompt.encode())
        finally:
            gw.stop()


def test_llama_cpp_server_from_its_url_alone(tmp_path):
    binary = llama_server_binary()
    if binary is None:
        pytest.skip(
            "llama.cpp's llama-server is not built: `make llama-server` (or "
            "`OUT=~/.cache/kvgate/llama-server bash studies/build_llama_server.sh`, or set "
            "KVGATE_LLAMA_SERVER)"
        )
    with llama_cpp_server(binary, tmp_path, UPSTREAM_ID) as url:
        gw = start_gateway(tmp_path, config=url_only(url + "/v1"), timeout=120)
        try:
            log = gw.log.read_text()
            assert f"model {UPSTREAM_ID!r} (discovered)" in log, log
            assert "context length 2048 (from /props n_ctx)" in log, log
            assert "tokenizer: the upstream's /tokenize (exact quotas)" in log, log
            (chat_prompt, _, _), (comp_prompt, _, _) = serves_with_exact_quotas(gw, tmp_path)
            # rendered by its own template and tokenizer: the prompts it prefilled
            tokenize = {"add_special": True, "parse_special": True}
            text = "The capital of France is"
            tokens = httpx.post(url + "/tokenize", json={"content": text, **tokenize}).json()
            assert comp_prompt == len(tokens["tokens"])
            chat = httpx.post(url + "/apply-template", json={"messages": QUESTION}).json()
            tokens = httpx.post(url + "/tokenize", json={"content": chat["prompt"], **tokenize})
            assert chat_prompt == len(tokens.json()["tokens"])
        finally:
            gw.stop()


class BareUpstream:
    """An OpenAI-compatible server that tells nothing: /v1/models and streamed
    /v1/chat/completions, with usage, and nothing else (no tokenizer, no context)."""

    PROMPT_TOKENS = 7
    PROMPT_DETAILS: dict = {}  # its usage's prompt_tokens_details, if any

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.port = free_port()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": UPSTREAM_ID}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        words = ["Hello", " there", "!"][: body["max_tokens"]]
        for i, word in enumerate(words):
            finish = "stop" if i == len(words) - 1 else None
            choice = {"index": 0, "delta": {"content": word}, "finish_reason": finish}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        usage = {"prompt_tokens": self.PROMPT_TOKENS, "completion_tokens": len(words)}
        if self.PROMPT_DETAILS:
            usage["prompt_tokens_details"] = self.PROMPT_DETAILS
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def app(self) -> web.Application:
        """Its routes (a subclass adds more)."""
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def __aenter__(self) -> BareUpstream:
        self.runner = web.AppRunner(self.app())
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


async def test_an_upstream_that_tells_nothing_is_served_from_a_text_bound(tmp_path):
    async with BareUpstream() as up:
        gw = await asyncio.to_thread(start_gateway, tmp_path, config=url_only(up.url))
        try:
            log = gw.log.read_text()
            assert "context length 8192 (assumed" in log and "no tokenizer" in log, log
            messages = [
                {"role": "system", "content": "Answer in French, s'il vous plaît."},
                {"role": "user", "content": "Bonjour, ça va ?"},
            ]
            bound = MARGIN + len(
                json.dumps(messages, ensure_ascii=False, separators=(",", ":")).encode()
            )
            # a tenant whose tpm is below the bound: refused before anything is sent
            _, small = await asyncio.to_thread(gw.tenant_key, "small", tpm=bound)
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=small, max_retries=0)
            with pytest.raises(openai.BadRequestError, match=f"The prompt alone is {bound} tokens"):
                await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
            assert up.bodies == []
            tenant, key = await asyncio.to_thread(gw.tenant_key, "big", tpm=bound + 3)
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
            reply = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=3
            )
            assert reply.choices[0].message.content == "Hello there!"
            # settled from the upstream's usage, not the bound
            assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (7, 3)
            sent = up.bodies[-1]
            assert sent["messages"] == messages and sent["model"] == UPSTREAM_ID
            rows = await asyncio.to_thread(wait_for_rows, tmp_path, tenant["id"], 1)
            assert rows == [(7, 3, 200)]
            # the window holds what was used (10), not what was reserved: a second fits
            again = await client.chat.completions.create(
                model=MODEL, messages=QUESTION, max_tokens=1
            )
            assert again.choices[0].message.content == "Hello"
            # its prompts' ids are bytes, not tokens: /tokenize says it cannot
            auth = {"Authorization": f"Bearer {key}"}
            ask = {"model": MODEL, "prompt": "hi"}
            r = await asyncio.to_thread(httpx.post, gw.url + "/tokenize", json=ask, headers=auth)
            assert r.status_code == 400 and "does not tokenize for the gateway" in r.text
            # nor can Anthropic's count_tokens (a count, not the bound), in its shape
            count = {"model": MODEL, "messages": QUESTION}
            r = await asyncio.to_thread(
                httpx.post, gw.url + "/v1/messages/count_tokens", json=count, headers=auth
            )
            assert r.status_code == 400 and r.json()["type"] == "error", r.text
            assert "does not tokenize for the gateway" in r.json()["error"]["message"]
            # ids made to look like a text-bound prompt, carrying no text: a 400, no 500
            for tokens in ([CHAT_MARK] * MARGIN + [300], [TEXT_MARK] * MARGIN + [0xFF], [1]):
                ask = {"model": MODEL, "tokens": tokens}
                r = await asyncio.to_thread(
                    httpx.post, gw.url + "/detokenize", json=ask, headers=auth
                )
                assert r.status_code == 400, r.text
        finally:
            await asyncio.to_thread(gw.stop)


def test_backends_that_cannot_serve_are_named_and_answer_503(tmp_path):
    """One upstream down at start (the watch keeps trying), one entry that cannot start
    (its tokenizer file is missing): /health names both, their models stay listed and
    answer a 503 that says why."""
    down = f"http://127.0.0.1:{free_port()}/v1"
    config = "\n".join(
        [
            url_only(down, model="down-model", name="down", start_timeout_s=1),
            url_only(down, model="broken-model", name="broken", tokenizer="/nonexistent.gguf"),
        ]
    )
    gw = start_gateway(tmp_path, config=config)
    try:
        log = gw.log.read_text()
        assert "is down (remote backend 'down' is unreachable)" in log, log
        assert "cannot load tokenizer '/nonexistent.gguf'" in log, log
        assert "(remote) DOWN for: broken-model" in log, log
        assert "(remote) not answering yet, for: down-model" in log, log
        health = httpx.get(gw.url + "/health")
        assert health.status_code == 200
        down_now = health.json()["down"]
        assert {n.split("@")[0] for n in down_now} == {"down", "broken"}
        reasons = " | ".join(down_now.values())
        assert "unreachable" in reasons and "cannot load tokenizer" in reasons
        _, key = gw.tenant_key("t")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        for model, why in (("down-model", "unreachable"), ("broken-model", "tokenizer")):
            with pytest.raises(openai.APIStatusError) as e:
                client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1)
            assert e.value.status_code == 503
            assert e.value.code == "backend_unavailable" and why in e.value.message
            if model == "down-model":  # the watch's words name no address
                assert "127.0.0.1" not in e.value.message
        assert {m.id for m in client.models.list()} >= {"down-model", "broken-model"}
    finally:
        gw.stop()


def test_the_text_bound_holds_the_tokens_a_real_tokenizer_makes():
    """A text-bound prompt's length is at least the tokens of the prompt the upstream
    renders: Gemma's tokenizer and turn format (the default GGUF), on text that packs
    the fewest bytes into a token (single bytes, emoji, CJK, control characters)."""
    tokenizer = load_tokenizer(str(default_model_path()))
    texts = ["a", "\x00\x01\x02", "🙂" * 50, "東京の天気は？" * 20, " " * 300, "a b " * 100, ""]
    for text in texts:
        chat = [{"role": "system", "content": text}, {"role": "user", "content": text or "?"}]
        assert len(text_bound(chat, None, MODEL)) >= len(tokenizer.render(chat))
        if text:
            assert len(text_bound(text, None, MODEL)) >= len(tokenizer.render(text))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = [{"role": "user", "content": "call f"}]
    assert len(text_bound(chat, tools, MODEL)) >= len(tokenizer.render(chat, tools))
    with pytest.raises(BadRequestError, match="token ids cannot be sent"):
        text_bound([1, 2, 3], None, MODEL)
    # only a text-bound backend's ids are a bound: another's real tokens may carry the marks
    bound = text_bound("hi", None, MODEL)
    assert marked(bound) and not is_text_bound(FakeBackend(fake_backends()[0]), bound)
